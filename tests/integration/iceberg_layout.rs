//! Workers' layouts in the table: a rescale's switch retires the old sink
//! ids on the table as it is at the switch's commit, not as it was read:
//! an old worker that claims its sink between the read and the commit
//! makes the switch decide again, and it is fenced all the same.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tinyflow_api::{StreamError, Worker};
use tinyflow_connectors_iceberg::{
    CatalogConfig, CommitStep, Fault, IcebergSink, load_table, retired, table_epoch, table_layout,
};

use crate::iceberg_sink::{NS, TABLE, config};

fn worker(s: &str) -> Worker {
    s.parse().unwrap()
}

#[tokio::test]
async fn an_old_worker_claiming_during_a_rescale_makes_the_switch_decide_again_and_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = CatalogConfig::sqlite(dir.path());
    // The first layout: 2 workers.
    let first = IcebergSink::new(config(dir.path(), "s"))
        .unwrap()
        .join_layout(worker("0/2"), None)
        .await
        .unwrap();
    assert!(first.switched);
    assert_eq!(first.sink_id, "s.w0-of-2.g1");
    let old = "s.w1-of-2.g1";
    assert_eq!(
        IcebergSink::new(config(dir.path(), old))
            .unwrap()
            .claim()
            .await
            .unwrap(),
        1
    );

    // Rescale 2 -> 3. Just before the switch's first catalog update, old
    // worker 1 claims its sink again (a restart of it): the table moved.
    let mut c = config(dir.path(), "s");
    let cfg = config(dir.path(), old);
    let once = Arc::new(AtomicBool::new(false));
    let hook_once = Arc::clone(&once);
    c.fault_hook = Some(Arc::new(move |step| {
        let (cfg, once) = (cfg.clone(), Arc::clone(&hook_once));
        Box::pin(async move {
            if matches!(step, CommitStep::BeforeUpdate { attempt: 0 })
                && !once.swap(true, Ordering::SeqCst)
            {
                let epoch = IcebergSink::new(cfg).unwrap().claim().await.unwrap();
                assert_eq!(epoch, 2, "the old worker's second claim");
            }
            Fault::Proceed
        })
    }));
    let joined = IcebergSink::new(c)
        .unwrap()
        .join_layout(worker("2/3"), Some("2@1".parse().unwrap()))
        .await
        .unwrap();
    assert!(once.load(Ordering::SeqCst), "the hook never ran");
    assert!(joined.switched);
    assert_eq!(joined.sink_id, "s.w2-of-3.g2");

    let table = load_table(&catalog, NS, TABLE).await.unwrap();
    let record = table_layout(&table, "s").unwrap().unwrap();
    assert_eq!((record.layout.generation, record.layout.workers), (2, 3));
    // Retired above the claim it raced with: read again, not as first read.
    assert_eq!(table_epoch(&table, old), 3);
    assert!(retired(&table, old).unwrap().contains("generation 2 of 3"));
    // A retired sink never claims again: an old worker started once more is
    // fenced for good.
    let err = IcebergSink::new(config(dir.path(), old))
        .unwrap()
        .claim()
        .await
        .unwrap_err();
    assert!(matches!(err, StreamError::Fenced { .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("retired by a rescale"), "{err}");

    // A rescale that names a layout the table no longer has is refused,
    // and the table keeps its layout.
    let err = IcebergSink::new(config(dir.path(), "s"))
        .unwrap()
        .join_layout(worker("0/2"), Some("3@1".parse().unwrap()))
        .await
        .unwrap_err();
    assert!(matches!(err, StreamError::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("--rescale-from 3@2"), "{err}");
    let table = load_table(&catalog, NS, TABLE).await.unwrap();
    assert_eq!(
        table_layout(&table, "s")
            .unwrap()
            .unwrap()
            .layout
            .generation,
        2
    );
}
