//! `tinyflow demo --metrics ADDR` end to end: the demo's own exactly-once
//! check passes, and a Prometheus scrape during the run shows the metrics
//! the user guide lists, with values that moved.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a panic is the failure report"
)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tinyflow_cli::metric_sum;

/// `GET /metrics` over plain HTTP; the body, or `None` while the endpoint
/// is not up.
fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    (head.starts_with("HTTP/1.") && head.contains(" 200 ")).then(|| body.to_owned())
}

#[test]
fn the_demo_checks_exactly_once_and_serves_its_metrics() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tinyflow"))
        .args([
            "demo",
            "--duration",
            "6s",
            "--rate",
            "5000",
            "--checkpoint-interval",
            "500ms",
        ])
        .arg("--dir")
        .arg(dir.path())
        .args(["--metrics", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Scrape until a commit shows, while the demo runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        if let Some(t) = scrape(port)
            && metric_sum(&t, "tinyflow_iceberg_commits_total", None) >= 1.0
        {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "no commit visible at /metrics within 60 s"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the demo ended before a scrape"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    for name in [
        "tinyflow_kafka_records_read_total",
        "tinyflow_records_in_total",
        "tinyflow_records_out_total",
        "tinyflow_iceberg_rows_written_total",
        "tinyflow_iceberg_files_written_total",
        "tinyflow_checkpoints_completed_total",
        "tinyflow_last_completed_checkpoint",
        "tinyflow_iceberg_last_committed_checkpoint",
    ] {
        assert!(
            metric_sum(&text, name, None) > 0.0,
            "{name} is missing or 0 in:\n{text}"
        );
    }
    for name in [
        "tinyflow_kafka_consumer_lag",
        "tinyflow_checkpoint_duration_seconds",
        "tinyflow_iceberg_commit_seconds",
    ] {
        assert!(text.contains(name), "{name} is missing in:\n{text}");
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("exactly once: every produced bid id"),
        "{stdout}"
    );
}
