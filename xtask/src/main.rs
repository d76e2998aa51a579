//! Project automation, run as `cargo xtask <command>`:
//!
//! - `ci`: everything CI checks, in order: formatting, clippy with warnings
//!   denied, all tests (unit, integration, property, doc; benches run once in
//!   test mode, so they are compiled and exercised), docs with warnings denied.
//! - `demo`: the runnable demo of what tinyflow does so far.
//!
//! Each step prints what it runs and how long it took; the first failure
//! stops the run with the step named.

#![allow(clippy::print_stderr, reason = "xtask reports progress on stderr")]

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("demo") => run(
            "demo",
            cargo(&[
                "run",
                "-p",
                "tinyflow-checkpoint",
                "--example",
                "checkpoint_demo",
                "--",
            ])
            .args(&args[1..]),
        ),
        _ => {
            eprintln!("usage: cargo xtask <ci|demo>");
            eprintln!("  ci    fmt check, clippy -D warnings, all tests, docs -D warnings");
            eprintln!("  demo  run the checkpoint demo (pass demo options after `demo`)");
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
    run(
        "tests",
        &mut cargo(&["test", "--workspace", "--all-targets", "--all-features"]),
    )?;
    run(
        "doc tests",
        &mut cargo(&["test", "--workspace", "--doc", "--all-features"]),
    )?;
    run(
        "docs",
        cargo(&["doc", "--workspace", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    eprintln!("xtask ci: all steps passed in {:.0?}", started.elapsed());
    Ok(())
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
