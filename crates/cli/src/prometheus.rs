//! The job's metrics: installing the Prometheus recorder, serving it with
//! the health endpoints, and
//! reading its text back (the demo's progress line, the end-of-job counters
//! line).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The job's HTTP endpoint (`metrics.address`): `/metrics` (Prometheus
/// text), `/healthz` (200 while the process serves) and `/readyz` (200 once
/// a checkpoint completed within `ready_window`, else 503 with the reason).
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Where it listens.
    pub address: SocketAddr,
    /// How recently a checkpoint must have completed for `/readyz`: a job
    /// that restored, runs, and whose every task takes part in checkpoints.
    pub ready_window: Duration,
}

/// Installs the global metrics recorder, with `labels` on every series
/// (a worker's `worker="I/N"`); with an endpoint, also serves it. The
/// handle renders what a scrape would see.
pub async fn install_metrics(
    endpoint: Option<Endpoint>,
    labels: &[(&str, String)],
) -> anyhow::Result<PrometheusHandle> {
    let mut builder = PrometheusBuilder::new();
    for (k, v) in labels {
        builder = builder.add_global_label(*k, v.clone());
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    // Without a scrape the histograms' buckets are never drained.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    if let Some(endpoint) = endpoint {
        let listener = tokio::net::TcpListener::bind(endpoint.address)
            .await
            .map_err(|e| anyhow::anyhow!("metrics endpoint on {}: {e}", endpoint.address))?;
        let health = Arc::new(Health {
            handle: handle.clone(),
            window: endpoint.ready_window,
            seen: Mutex::new((0.0, Instant::now())),
        });
        // Watches the counter once a second, so that readiness dates a
        // checkpoint from when it completed, not from when a probe looked.
        let watch = Arc::clone(&health);
        tokio::spawn(async move {
            loop {
                watch.observe();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        tokio::spawn(serve(listener, health));
        tracing::info!(address = %endpoint.address, "serving /metrics, /healthz and /readyz");
    }
    Ok(handle)
}

/// What `/readyz` decides on: the completed checkpoints counter, and when
/// it last grew.
struct Health {
    handle: PrometheusHandle,
    window: Duration,
    /// The counter as last seen, and when it grew.
    seen: Mutex<(f64, Instant)>,
}

impl Health {
    /// Reads the completed checkpoints counter and notes when it grew.
    fn observe(&self) -> (f64, Instant) {
        let completed = metric_sum(
            &self.handle.render(),
            "tinyflow_checkpoints_completed_total",
            None,
        );
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if completed > seen.0 {
            *seen = (completed, Instant::now());
        }
        *seen
    }

    /// `Ok` when ready, else why not.
    fn ready(&self) -> Result<String, String> {
        let (completed, at) = self.observe();
        let since = at.elapsed();
        if completed <= 0.0 {
            Err("starting: no checkpoint completed yet in this process".to_owned())
        } else if since > self.window {
            Err(format!(
                "no checkpoint completed for {} s (the window is {} s): the job restarts, or a task is stuck",
                since.as_secs(),
                self.window.as_secs()
            ))
        } else {
            Ok(format!(
                "ready: {completed} checkpoints completed, the last within {} s",
                since.as_secs()
            ))
        }
    }
}

/// Most connections the endpoint serves at once; more are closed at once.
const MAX_CONNECTIONS: usize = 32;

/// How long one connection may take, from accept to the last byte sent.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the endpoint: one request per connection, HTTP/1.1 with
/// `Connection: close` (what probes and scrapers need). A connection gets
/// [`CONNECTION_TIMEOUT`] in all, and at most [`MAX_CONNECTIONS`] are
/// served at once, so slow or many clients cannot hold the job's sockets.
async fn serve(listener: tokio::net::TcpListener, health: Arc<Health>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "the metrics endpoint could not accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, "the metrics endpoint is busy: closing a connection");
            continue;
        };
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            match tokio::time::timeout(CONNECTION_TIMEOUT, answer(stream, &health)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "a metrics endpoint connection failed")
                }
                Err(_) => tracing::debug!(%peer, "a metrics endpoint connection took too long"),
            }
            drop(slot);
        });
    }
}

async fn answer(mut stream: tokio::net::TcpStream, health: &Health) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    // The request line and headers; bodies are not expected.
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 16 * 1024 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&request);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4",
            health.handle.render(),
        ),
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_owned()),
        ("GET", "/readyz") => match health.ready() {
            Ok(why) => ("200 OK", "text/plain", why + "\n"),
            Err(why) => ("503 Service Unavailable", "text/plain", why + "\n"),
        },
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "not found: /metrics, /healthz and /readyz are served\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_owned(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// Sums metric `name` over its series whose labels contain `label` (all
/// when `None`), from Prometheus text (what `/metrics` serves).
///
/// ```
/// let text = "# TYPE x counter\nx{subtask=\"0\"} 2\nx{subtask=\"1\"} 3\nxy 9\n";
/// assert_eq!(tinyflow_cli::metric_sum(text, "x", None), 5.0);
/// assert_eq!(tinyflow_cli::metric_sum(text, "x", Some("subtask=\"1\"")), 3.0);
/// ```
pub fn metric_sum(text: &str, name: &str, label: Option<&str>) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            (n == name && label.is_none_or(|want| labels.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// The key counters of a job in one line, from Prometheus text (what
/// `/metrics` serves): records read, bad records by reason, rows written,
/// checkpoints, commits, the catalog updates commits tried and lost to
/// other commits (other workers), and merges before commits (and those that
/// failed). For the log when a job ends.
///
/// ```
/// let text = "tinyflow_kafka_records_read_total{subtask=\"0\"} 10\n\
///     tinyflow_bad_records_total{operator=\"kafka\",reason=\"invalid_json\",subtask=\"0\"} 2\n";
/// assert_eq!(
///     tinyflow_cli::counters_line(text),
///     "records_read=10 bad_records=2 (invalid_json=2) rows_written=0 rows_skipped_by_sink=0 \
///      checkpoints_completed=0 checkpoints_failed=0 commits=0 commit_attempts=0 commit_conflicts=0 \
///      merges=0 merge_failures=0"
/// );
/// ```
pub fn counters_line(text: &str) -> String {
    // Counters are whole numbers (an empty sum of f64 is -0).
    let sum = |name| metric_sum(text, name, None) as u64;
    let mut by_reason: BTreeMap<&str, u64> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = l.rsplit_once(' ') else {
            continue;
        };
        let Some(labels) = series
            .strip_prefix("tinyflow_bad_records_total{")
            .and_then(|s| s.strip_suffix('}'))
        else {
            continue;
        };
        let reason = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("reason=\""))
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or("unknown");
        *by_reason.entry(reason).or_default() += value.parse::<f64>().unwrap_or(0.0) as u64;
    }
    let reasons: Vec<String> = by_reason.iter().map(|(r, n)| format!("{r}={n}")).collect();
    let bad = if reasons.is_empty() {
        "0".to_owned()
    } else {
        format!(
            "{} ({})",
            by_reason.values().sum::<u64>(),
            reasons.join(" ")
        )
    };
    format!(
        "records_read={} bad_records={bad} rows_written={} rows_skipped_by_sink={} checkpoints_completed={} checkpoints_failed={} commits={} commit_attempts={} commit_conflicts={} merges={} merge_failures={}",
        sum("tinyflow_kafka_records_read_total"),
        sum("tinyflow_iceberg_rows_written_total"),
        sum("tinyflow_iceberg_bad_records_total"),
        sum("tinyflow_checkpoints_completed_total"),
        sum("tinyflow_checkpoints_failed_total"),
        sum("tinyflow_iceberg_commits_total"),
        sum("tinyflow_iceberg_commit_attempts_total"),
        sum("tinyflow_iceberg_commit_conflicts_total"),
        sum("tinyflow_iceberg_merges_total"),
        sum("tinyflow_iceberg_merge_failures_total"),
    )
}
