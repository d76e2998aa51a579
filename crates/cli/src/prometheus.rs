//! The job's metrics: installing the Prometheus recorder and endpoint, and
//! reading its text back (the demo's progress line, the end-of-job counters
//! line).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Installs the global metrics recorder; with an address, also serves
/// `http://address/metrics`. The handle renders what a scrape would see.
pub fn install_metrics(address: Option<SocketAddr>) -> anyhow::Result<PrometheusHandle> {
    let builder = PrometheusBuilder::new();
    match address {
        Some(addr) => {
            let (recorder, exporter) = builder
                .with_http_listener(addr)
                .build()
                .map_err(|e| anyhow::anyhow!("metrics endpoint on {addr}: {e}"))?;
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)
                .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
            tokio::spawn(async move {
                if let Err(e) = exporter.await {
                    tracing::error!(error = ?e, "the metrics endpoint stopped");
                }
            });
            tracing::info!(address = %addr, "serving Prometheus metrics at /metrics");
            Ok(handle)
        }
        None => builder
            .install_recorder()
            .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}")),
    }
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
/// checkpoints, commits. For the log when a job ends.
///
/// ```
/// let text = "tinyflow_kafka_records_read_total{subtask=\"0\"} 10\n\
///     tinyflow_bad_records_total{operator=\"kafka\",reason=\"invalid_json\",subtask=\"0\"} 2\n";
/// assert_eq!(
///     tinyflow_cli::counters_line(text),
///     "records_read=10 bad_records=2 (invalid_json=2) rows_written=0 rows_skipped_by_sink=0 \
///      checkpoints_completed=0 checkpoints_failed=0 commits=0"
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
        "records_read={} bad_records={bad} rows_written={} rows_skipped_by_sink={} checkpoints_completed={} checkpoints_failed={} commits={}",
        sum("tinyflow_kafka_records_read_total"),
        sum("tinyflow_iceberg_rows_written_total"),
        sum("tinyflow_iceberg_bad_records_total"),
        sum("tinyflow_checkpoints_completed_total"),
        sum("tinyflow_checkpoints_failed_total"),
        sum("tinyflow_iceberg_commits_total"),
    )
}
