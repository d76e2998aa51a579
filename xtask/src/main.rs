//! Project automation, run as `cargo xtask <command>`:
//!
//! - `ci`: everything CI checks, in order: formatting, clippy with warnings
//!   denied (all features, then the product build without test features),
//!   all tests (unit, integration, property, doc; benches run once in
//!   test mode, so they are compiled and exercised) with a real Kafka broker
//!   started for them and stopped after, pyiceberg installed for them, docs
//!   with warnings denied, and the example Kubernetes manifests.
//! - `demo`: the README's demo (`tinyflow demo`: Kafka to Iceberg, no setup).
//! - `kafka start|stop|status`: a real Apache Kafka broker on loopback for
//!   integration tests (see `kafka.rs`).
//! - `postgres start|stop|status`: a throwaway PostgreSQL server on
//!   loopback for the Iceberg SQL catalog tests (see `postgres.rs`).
//! - `iceberg-rest start|stop|status`: Apache Iceberg's REST catalog server
//!   on loopback for the REST catalog tests (see `rest.rs`).
//! - `s3 start|stop|status`: an S3 server (S3Proxy) on loopback for the tests
//!   of tables on S3 storage (see `s3.rs`).
//! - `keycloak start|stop|status`: Keycloak, an OpenID Connect identity
//!   provider on loopback, for the tests of OAUTHBEARER with OIDC (see
//!   `keycloak.rs`).
//! - `py-setup`: pyiceberg in `target/pyiceberg-venv`, the independent
//!   reader of the Iceberg tests (see `python.rs`).
//! - `k8s-validate [--tinyflow PATH]`: the manifests in `deploy/kubernetes`
//!   against one Kubernetes version's schemas, offline (see `kubernetes.rs`).
//!
//! Each step prints what it runs and how long it took; the first failure
//! stops the run with the step named.

#![allow(
    clippy::print_stderr,
    clippy::print_stdout,
    reason = "xtask reports progress on stderr and echoes test output on stdout"
)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

mod java;
mod kafka;
mod keycloak;
mod kubernetes;
mod postgres;
mod python;
mod rest;
mod s3;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("kafka") => kafka::main(&args[1..]),
        Some("postgres") => postgres::main(&args[1..]),
        Some("iceberg-rest") => java::main(&rest::SPEC, &args[1..]),
        Some("s3") => java::main(&s3::SPEC, &args[1..]),
        Some("keycloak") => java::main(&keycloak::SPEC, &args[1..]),
        Some("py-setup") => python::setup().map(|p| println!("{}", p.display())),
        Some("k8s-validate") => kubernetes::main(&args[1..]),
        Some("demo") => run(
            "demo",
            cargo(&["run", "-p", "tinyflow-cli", "--", "demo"]).args(&args[1..]),
        ),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci|demo|kafka|postgres|iceberg-rest|s3|keycloak|py-setup|k8s-validate>"
            );
            eprintln!("  ci    fmt check, clippy -D warnings, all tests, docs -D warnings");
            eprintln!(
                "  demo  run the README's demo, `tinyflow demo` (pass its options after `demo`)"
            );
            eprintln!(
                "  kafka start|stop|kill|restart|resume|discard|status [--port N] [--secured] [--oidc-issuer URL]: a local Kafka broker for tests"
            );
            eprintln!(
                "  postgres start|stop|status [--port N]: a throwaway PostgreSQL server for the catalog tests"
            );
            eprintln!(
                "  iceberg-rest start|stop|status [--port N]: Iceberg's REST catalog server for the catalog tests"
            );
            eprintln!(
                "  s3 start|stop|status [--port N]: an S3 server (S3Proxy) for the tests of tables on S3"
            );
            eprintln!(
                "  keycloak start|stop|status [--port N]: an OpenID Connect identity provider for the OAUTHBEARER tests"
            );
            eprintln!("  py-setup  install pyiceberg (the tests' independent Iceberg reader)");
            eprintln!(
                "  k8s-validate [--tinyflow PATH]: check deploy/kubernetes against Kubernetes' schemas, offline"
            );
            bail!("unknown or missing command {:?}", args.first());
        }
    }
}

fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.args(args);
    cmd
}

fn ci() -> Result<()> {
    let started = Instant::now();
    run("format", &mut cargo(&["fmt", "--all", "--check"]))?;
    run(
        "clippy",
        &mut cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // The product as a user builds it: no test features (the commit fault
    // hook, the chaos knob), which the step above always turns on.
    run(
        "clippy, product build",
        &mut cargo(&[
            "clippy",
            "-p",
            "tinyflow-cli",
            "-p",
            "tinyflow-connectors-iceberg",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    let mut counts = TestCounts::default();
    // The Iceberg tests read tables back with pyiceberg.
    let python = python::setup()?;
    // An OpenID Connect identity provider, started before the broker, which
    // checks the tokens it issues with the keys it publishes.
    let idp = java::ci_start(&keycloak::SPEC)?;
    // Integration tests read and write a real Kafka broker; it stops when
    // `broker` is dropped, also when a step fails.
    let broker = kafka::CiBroker::start(&idp.url)?;
    // The Iceberg SQL catalog on PostgreSQL, as in production.
    let postgres = postgres::ci_start()?;
    // Iceberg's REST catalog server, the other production catalog.
    let rest = java::ci_start(&rest::SPEC)?;
    // An S3 server, for tables whose files live on S3.
    let s3 = java::ci_start(&s3::SPEC)?;
    let mut tests = cargo(&["test", "--workspace", "--all-targets", "--all-features"]);
    // The secured listener's address, CA and user, for the TLS and SASL tests.
    tests.envs(broker.secured.iter().map(|(k, v)| (k, v)));
    run_tests(
        "tests",
        tests
            .env("KAFKA_BOOTSTRAP", &broker.bootstrap)
            .env("TINYFLOW_POSTGRES_URL", &postgres.url)
            .env("TINYFLOW_REST_CATALOG_URL", &rest.url)
            .env("TINYFLOW_S3_ENDPOINT", &s3.url)
            .env("TINYFLOW_OIDC_ISSUER", &idp.url)
            .envs(keycloak::SPEC.env.iter().copied())
            .env("TINYFLOW_PYTHON", &python)
            // Tests that stop and restart a broker of their own run this
            // binary's `kafka` command.
            .env("TINYFLOW_XTASK", std::env::current_exe()?),
        &mut counts,
    )?;
    drop(broker);
    drop(postgres);
    drop(rest);
    drop(s3);
    drop(idp);
    // The README's demo command, shortened: it checks exactly-once itself
    // and fails when the table does not hold every bid once. The tests
    // built the binary (the chaos test needs it) next to this one.
    let tinyflow = std::env::current_exe()?.with_file_name("tinyflow");
    run(
        "demo",
        Command::new(&tinyflow).args(["demo", "--duration", "5s", "--dir", "target/demo-ci"]),
    )?;
    // The example Kubernetes manifests, and their job file with that binary.
    kubernetes::validate(&python, Some(&tinyflow))?;
    run_tests(
        "doc tests",
        &mut cargo(&["test", "--workspace", "--doc", "--all-features"]),
        &mut counts,
    )?;
    run(
        "docs",
        cargo(&["doc", "--workspace", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    eprintln!("xtask ci: all steps passed in {:.0?}", started.elapsed());
    // One closing line over every test binary, so a reader (or CI) sees the
    // total rather than the last binary's count.
    println!("tests: {} passed, {} failed", counts.passed, counts.failed);
    Ok(())
}

/// `<command> [--port N]`: the command, and the port from `--port`, else
/// the variable `env`, else `default`.
pub(crate) fn command_and_port(
    args: &[String],
    env: &str,
    default: u16,
    usage: &str,
) -> Result<(String, u16)> {
    let mut command = None;
    let mut port = std::env::var(env)
        .ok()
        .map(|p| p.trim().parse::<u16>())
        .transpose()
        .with_context(|| format!("{env}: expected a port number"))?
        .unwrap_or(default);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if arg == "--port" {
            port = it
                .next()
                .context("--port needs a number")?
                .parse()
                .context("--port: expected a port number")?;
        } else if command.is_none() {
            command = Some(arg.clone());
        } else {
            bail!("unexpected argument `{arg}`; {usage}");
        }
    }
    Ok((command.context(usage.to_owned())?, port))
}

/// A server `cargo xtask ci` started for the tests, stopped when dropped
/// (also when a step fails); or the one an environment variable names
/// already, left alone.
pub(crate) struct CiServer<S: CiStop> {
    server: Option<S>,
    /// The xtask command's name, for messages.
    name: &'static str,
    /// What the tests get in that variable.
    pub(crate) url: String,
}

/// How [`CiServer`] stops what it started.
pub(crate) trait CiStop {
    /// Stops the server and deletes what it kept.
    fn stop_server(&self) -> Result<()>;
}

impl<S: CiStop> CiServer<S> {
    /// The server `env` names, else the one `start` starts (returning its
    /// URL and itself); `name` is the xtask command's.
    pub(crate) fn start(
        name: &'static str,
        env: &str,
        start: impl FnOnce() -> Result<(String, S)>,
    ) -> Result<Self> {
        if let Ok(url) = std::env::var(env) {
            eprintln!("xtask {name}: using {env}={url}");
            return Ok(CiServer {
                server: None,
                name,
                url,
            });
        }
        let (url, server) = start()?;
        Ok(CiServer {
            server: Some(server),
            name,
            url,
        })
    }
}

impl<S: CiStop> Drop for CiServer<S> {
    fn drop(&mut self) {
        if let Some(server) = &self.server
            && let Err(e) = server.stop_server()
        {
            eprintln!("xtask {}: stopping the server failed: {e:#}", self.name);
        }
    }
}

#[derive(Debug, Default)]
struct TestCounts {
    passed: u64,
    failed: u64,
}

/// Runs a `cargo test` step, echoing its output and adding up the counts of
/// its `test result:` lines.
fn run_tests(step: &str, cmd: &mut Command, counts: &mut TestCounts) -> Result<()> {
    eprintln!("xtask: [{step}] {cmd:?}");
    let started = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting step {step}"))?;
    let stdout = child.stdout.take().context("test output pipe")?;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading test output")?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            counts.passed += count_before(rest, " passed");
            counts.failed += count_before(rest, " failed");
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for step {step}"))?;
    eprintln!(
        "xtask: [{step}] finished in {:.1?} ({status})",
        started.elapsed()
    );
    if !status.success() {
        println!(
            "tests: {} passed, {} failed",
            counts.passed,
            counts.failed.max(1)
        );
        bail!("step {step} failed ({status})");
    }
    Ok(())
}

/// The number just before `word` in a `test result:` line, e.g. 33 in
/// `ok. 33 passed; 0 failed; ...`.
fn count_before(line: &str, word: &str) -> u64 {
    line.find(word)
        .and_then(|end| line[..end].rsplit(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn run(step: &str, cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: [{step}] {cmd:?}");
    let started = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("starting step {step}"))?;
    eprintln!(
        "xtask: [{step}] finished in {:.1?} ({status})",
        started.elapsed()
    );
    if !status.success() {
        bail!("step {step} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::count_before;

    #[test]
    fn counts_are_read_from_test_result_lines() {
        let line =
            "ok. 33 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 7.20s";
        assert_eq!(count_before(line, " passed"), 33);
        assert_eq!(count_before(line, " failed"), 2);
        assert_eq!(count_before("FAILED. 0 passed; 1 failed;", " failed"), 1);
        assert_eq!(count_before("nothing here", " passed"), 0);
    }
}
