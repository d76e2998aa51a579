//! `tinyflow inspect CATALOG TABLE`: a table's snapshots with the
//! checkpoint ids, watermarks and source positions tinyflow wrote into their
//! summaries.

#![allow(clippy::print_stdout, reason = "the command's output")]

use std::collections::HashMap;

use anyhow::{Context, bail};
use tinyflow_api::JobPositions;
use tinyflow_connectors_iceberg::{
    CatalogConfig, SUMMARY_CHECKPOINT_ID, SUMMARY_SINK_ID, SUMMARY_SOURCE_POSITIONS,
    SUMMARY_WATERMARK, load_table,
};

/// `tinyflow inspect` options.
#[derive(Debug, clap::Args)]
pub(crate) struct InspectArgs {
    /// A job file (`JOB.toml`: the job's state beside its table), or a
    /// sqlite catalog's directory (holding catalog.db and warehouse/), a
    /// SQL catalog URI (`postgres://...`, `sqlite:...`; then --warehouse),
    /// or a REST catalog server's `http(s)://host:port`.
    catalog: String,
    /// The table, `namespace.table` (not with a job file).
    table: Option<String>,
    /// The warehouse of a SQL catalog given by URI (for a REST catalog: the
    /// warehouse to ask the server for, if it serves several).
    #[arg(long)]
    warehouse: Option<String>,
    /// The catalog's name (default tinyflow).
    #[arg(long, default_value = "tinyflow")]
    catalog_name: String,
}

fn catalog_config(args: &InspectArgs) -> anyhow::Result<CatalogConfig> {
    if args.catalog.starts_with("http://") || args.catalog.starts_with("https://") {
        return Ok(CatalogConfig::Rest {
            name: args.catalog_name.clone(),
            uri: args.catalog.clone(),
            warehouse: args.warehouse.clone(),
            properties: HashMap::new(),
        });
    }
    if args.catalog.contains("://") || args.catalog.starts_with("sqlite:") {
        let warehouse = args
            .warehouse
            .clone()
            .context("a catalog given by URI needs --warehouse")?;
        return Ok(CatalogConfig::Sql {
            name: args.catalog_name.clone(),
            uri: args.catalog.clone(),
            warehouse,
            properties: HashMap::new(),
        });
    }
    let dir = tinyflow_cli::absolute_path(&args.catalog);
    if !dir.join("catalog.db").is_file() {
        bail!(
            "{} has no catalog.db: not a sqlite catalog directory",
            dir.display()
        );
    }
    let CatalogConfig::Sql { uri, warehouse, .. } = CatalogConfig::sqlite(&dir) else {
        unreachable!("sqlite() is a SQL catalog")
    };
    Ok(CatalogConfig::Sql {
        name: args.catalog_name.clone(),
        uri,
        warehouse,
        properties: HashMap::new(),
    })
}

/// The source positions of a snapshot summary, one `source: name@position`
/// per partition, or why there are none.
fn positions_line(summary: &HashMap<String, String>) -> String {
    let Some(json) = summary.get(SUMMARY_SOURCE_POSITIONS) else {
        return "none recorded".to_owned();
    };
    match serde_json::from_str::<JobPositions>(json) {
        Ok(all) => all
            .iter()
            .flat_map(|(source, at)| at.iter().map(move |(k, v)| format!("{source}: {k}@{v}")))
            .collect::<Vec<_>>()
            .join("  "),
        Err(e) => format!("unreadable ({e}): {json}"),
    }
}

fn millis_utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = tinyflow_api::util::civil_date(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

pub(crate) async fn run(args: InspectArgs) -> anyhow::Result<()> {
    let Some(table_name) = args.table.clone() else {
        return inspect_job(std::path::Path::new(&args.catalog)).await;
    };
    let config = catalog_config(&args)?;
    let (ns, name) = table_name
        .rsplit_once('.')
        .context("TABLE: expected namespace.table")?;
    let table = load_table(&config, ns, name).await?;
    let meta = table.metadata();
    println!("table {table_name} at {}", meta.location());
    let committed: Vec<_> = meta
        .properties()
        .iter()
        .filter(|(k, _)| k.starts_with("tinyflow."))
        .collect();
    for (k, v) in committed {
        println!("  property {k} = {v}");
    }
    let mut snapshots: Vec<_> = meta.snapshots().collect();
    snapshots.sort_by_key(|s| s.sequence_number());
    println!(
        "{:>20}  {:<24}  {:>10}  {:>12}  {:>6}  {:<12}  {:>10}  {:<24}",
        "snapshot",
        "committed at",
        "added rows",
        "total rows",
        "files",
        "sink",
        "checkpoint",
        "watermark"
    );
    for s in snapshots {
        let p = &s.summary().additional_properties;
        let get = |k: &str| p.get(k).cloned().unwrap_or_else(|| "-".to_owned());
        let watermark = p
            .get(SUMMARY_WATERMARK)
            .and_then(|w| w.parse::<i64>().ok())
            .map_or_else(|| "-".to_owned(), millis_utc);
        let checkpoint = get(SUMMARY_CHECKPOINT_ID);
        println!(
            "{:>20}  {:<24}  {:>10}  {:>12}  {:>6}  {:<12}  {:>10}  {:<24}",
            s.snapshot_id(),
            millis_utc(s.timestamp_ms()),
            get("added-records"),
            get("total-records"),
            get("added-data-files"),
            get(SUMMARY_SINK_ID),
            checkpoint,
            watermark,
        );
        println!("{:>20}  source positions: {}", "", positions_line(p));
    }
    Ok(())
}

/// `tinyflow inspect JOB.toml`: an error (exit 4) when a run would refuse
/// the job's state.
async fn inspect_job(job: &std::path::Path) -> anyhow::Result<()> {
    let plan = tinyflow_cli::JobFile::load(job)?
        .resolve_schema()
        .await?
        .plan()?;
    let agreement = match tinyflow_cli::jobstate::inspect_workers(&plan).await? {
        Some(a) => a,
        None => tinyflow_cli::jobstate::inspect(&plan).await?,
    };
    match agreement {
        tinyflow_cli::jobstate::Agreement::Agree => Ok(()),
        tinyflow_cli::jobstate::Agreement::Disagree => Err(anyhow::Error::new(
            tinyflow_api::StreamError::StateMismatch {
                operator: format!("job {}", plan.job_id),
                target: format!(
                    "table {}.{}",
                    plan.sink.namespace.join("."),
                    plan.sink.table
                ),
                message: "see the verdict above".to_owned(),
            },
        )),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn positions_read_from_the_summary() {
        let summary = |json: &str| {
            std::collections::HashMap::from([(
                super::SUMMARY_SOURCE_POSITIONS.to_owned(),
                json.to_owned(),
            )])
        };
        assert_eq!(
            super::positions_line(&summary(r#"{"kafka":{"bids/0":"12","bids/1":"7"}}"#)),
            "kafka: bids/0@12  kafka: bids/1@7"
        );
        assert_eq!(super::positions_line(&Default::default()), "none recorded");
        assert!(super::positions_line(&summary("{")).starts_with("unreadable"));
    }

    #[test]
    fn utc_times_format_as_iso_8601() {
        assert_eq!(super::millis_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::millis_utc(1_767_225_600_123),
            "2026-01-01T00:00:00.123Z"
        );
        assert_eq!(
            super::millis_utc(951_782_400_000),
            "2000-02-29T00:00:00.000Z"
        );
    }
}
