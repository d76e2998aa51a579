//! The house rules that a compiler does not check: which crate may depend
//! on which (ARCHITECTURE.md's code map), and that only the connectors name
//! rdkafka and iceberg, so a user who needs no Kafka compiles no librdkafka
//! and one who needs no Iceberg compiles no iceberg.
//!
//! Read from `cargo metadata` (the manifests as cargo sees them) and from
//! the sources, so a rule broken in either place fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::LazyLock;

/// The workspace's product crates and the tinyflow crates each may depend
/// on (normal and build dependencies; dev-dependencies, and the `tests` and
/// `benches` packages, may use anything).
const LAYERS: &[(&str, &[&str])] = &[
    ("tinyflow-api", &[]),
    ("tinyflow-checkpoint", &["tinyflow-api"]),
    ("tinyflow-runtime", &["tinyflow-api", "tinyflow-checkpoint"]),
    ("tinyflow-connectors-kafka", &["tinyflow-api"]),
    ("tinyflow-connectors-iceberg", &["tinyflow-api"]),
    (
        "tinyflow-cli",
        &[
            "tinyflow-api",
            "tinyflow-checkpoint",
            "tinyflow-runtime",
            "tinyflow-connectors-kafka",
            "tinyflow-connectors-iceberg",
        ],
    ),
    (
        "tinyflow-examples",
        &[
            "tinyflow-api",
            "tinyflow-runtime",
            "tinyflow-connectors-kafka",
            "tinyflow-connectors-iceberg",
        ],
    ),
];

/// Heavy clients and the one crate allowed to name each (by dependency name
/// prefix, so `iceberg-catalog-sql` counts as iceberg).
const CLIENTS: &[(&str, &str)] = &[
    ("rdkafka", "tinyflow-connectors-kafka"),
    ("iceberg", "tinyflow-connectors-iceberg"),
];

/// Whether a dependency of this kind is held to the rules: normal and build
/// dependencies always; dev-dependencies only for the examples, whose every
/// dependency is one (they are what a user's job would depend on).
fn counts(package: &str, kind: &str) -> bool {
    kind != "dev" || package == "tinyflow-examples"
}

struct Package {
    /// Dependencies by name, with their kind (`normal`, `dev`, `build`).
    deps: Vec<(String, String)>,
    /// The package's directory.
    dir: PathBuf,
}

/// The workspace's packages, read once for all the rules.
fn workspace() -> &'static BTreeMap<String, Package> {
    static PACKAGES: LazyLock<BTreeMap<String, Package>> = LazyLock::new(read_workspace);
    &PACKAGES
}

fn read_workspace() -> BTreeMap<String, Package> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let mut packages = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("name").to_owned();
        let manifest = PathBuf::from(p["manifest_path"].as_str().expect("manifest_path"));
        let deps = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .map(|d| {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                (
                    d["name"].as_str().expect("dependency name").to_owned(),
                    kind,
                )
            })
            .collect();
        let dir = manifest
            .parent()
            .expect("a manifest has a directory")
            .to_owned();
        packages.insert(name, Package { deps, dir });
    }
    packages
}

#[test]
fn product_crates_depend_only_on_the_layers_below_them() {
    let packages = workspace();
    let mut broken = Vec::new();
    for (name, allowed) in LAYERS {
        let package = packages
            .get(*name)
            .unwrap_or_else(|| panic!("{name} is not in the workspace"));
        let allowed: BTreeSet<&str> = allowed.iter().copied().collect();
        for (dep, kind) in &package.deps {
            if counts(name, kind) && dep.starts_with("tinyflow-") && !allowed.contains(dep.as_str())
            {
                broken.push(format!("{name} depends on {dep} ({kind})"));
            }
        }
    }
    assert!(broken.is_empty(), "layering broken: {broken:#?}");
}

#[test]
fn only_the_connectors_depend_on_rdkafka_and_iceberg() {
    let packages = workspace();
    let mut broken = Vec::new();
    for (name, _) in LAYERS {
        for (dep, kind) in &packages[*name].deps {
            for (client, owner) in CLIENTS {
                if counts(name, kind) && dep.starts_with(client) && name != owner {
                    broken.push(format!(
                        "{name} depends on {dep} ({kind}); only {owner} may"
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Every `.rs` file below `dir` that goes into the product: not a
/// package's own `tests/` or `benches/`, which may drive the clients
/// directly (through dev-dependencies).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path
                .file_name()
                .is_some_and(|n| n != "target" && n != "tests" && n != "benches")
            {
                sources(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn only_the_connectors_name_rdkafka_and_iceberg_in_their_code() {
    let packages = workspace();
    let mut broken = Vec::new();
    for (name, _) in LAYERS {
        let mut files = Vec::new();
        sources(&packages[*name].dir, &mut files);
        assert!(!files.is_empty(), "no sources found for {name}");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("reading a source file");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                for (client, owner) in CLIENTS {
                    let named = code.contains(&format!("{client}::"))
                        && !code.contains(&format!("_{client}::"))
                        && !code.contains(&format!("-{client}::"));
                    if named && name != owner {
                        broken.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "only the connectors may name these clients: {broken:#?}"
    );
}
