//! `cargo xtask k8s-validate [--tinyflow PATH]`: the example Kubernetes
//! manifests in `deploy/kubernetes` checked offline against the schemas of
//! one Kubernetes version, [`KUBERNETES_VERSION`], with
//! `kubernetes-validate` (a PyPI package that carries the schemas; it is
//! installed into the tests' venv by `py-setup`), and across files by
//! `tools/kubernetes/validate.py` (replicas and `TINYFLOW_WORKERS`, the
//! Secret and ConfigMap keys the StatefulSet takes, the Kustomization's
//! list). With `--tinyflow`, `tinyflow validate` also checks the ConfigMap's
//! job file in the environment a pod gets. No container engine and no
//! cluster are needed.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

/// The version whose schemas the manifests must satisfy: the oldest the
/// example is for (the StatefulSet's PVC retention policy, shown commented
/// out, is GA from 1.32).
const KUBERNETES_VERSION: &str = "1.32.0";

/// The workspace root (xtask runs from anywhere in it).
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
}

/// `k8s-validate [--tinyflow PATH]`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let mut tinyflow = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--tinyflow" => match it.next() {
                Some(path) => tinyflow = Some(PathBuf::from(path)),
                None => bail!("--tinyflow needs the path of a tinyflow binary"),
            },
            other => bail!(
                "unexpected argument `{other}`; usage: cargo xtask k8s-validate [--tinyflow PATH]"
            ),
        }
    }
    let python = crate::python::setup()?;
    validate(&python, tinyflow.as_deref())
}

/// Runs the check with the venv's `python`, as the step `k8s-validate`;
/// fails when a manifest does not validate or the validator is missing.
pub(crate) fn validate(python: &Path, tinyflow: Option<&Path>) -> Result<()> {
    let root = root();
    let mut cmd = Command::new(python);
    cmd.arg(root.join("tools/kubernetes/validate.py"))
        .args(["--kubernetes-version", KUBERNETES_VERSION])
        .arg(root.join("deploy/kubernetes"));
    if let Some(tinyflow) = tinyflow {
        cmd.arg("--tinyflow").arg(tinyflow);
    }
    crate::run("k8s-validate", &mut cmd)
}
