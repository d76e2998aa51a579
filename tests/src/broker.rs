//! A Kafka broker of a test's own, on a free port, that the test may stop
//! and restart (the shared one from `KAFKA_BOOTSTRAP` must stay up for the
//! other tests). It runs `$TINYFLOW_XTASK kafka start|stop|kill|resume|discard
//! --port N`,
//! which `cargo xtask ci` sets to its own binary.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;

/// A broker started for one test; killed and its data deleted on drop.
#[derive(Debug)]
pub struct OwnBroker {
    xtask: PathBuf,
    port: u16,
    /// `host:port`.
    pub bootstrap: String,
}

impl OwnBroker {
    /// Starts a broker on a free port.
    ///
    /// # Panics
    /// When `TINYFLOW_XTASK` is not set (saying how to run the test), or the
    /// broker does not start.
    pub fn start() -> OwnBroker {
        let xtask = std::env::var_os("TINYFLOW_XTASK").map(PathBuf::from).unwrap_or_else(|| {
            panic!(
                "TINYFLOW_XTASK is not set: this test starts and restarts a Kafka broker of its own \
                 with the xtask binary. Run `cargo xtask ci`, or set TINYFLOW_XTASK=target/debug/xtask \
                 after `cargo build -p xtask`"
            )
        });
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free port");
        let mut broker = OwnBroker {
            xtask,
            port,
            bootstrap: String::new(),
        };
        broker.bootstrap = broker.run("start");
        broker
    }

    /// Stops the broker (SIGTERM, waiting for it to exit; Kafka's
    /// controlled shutdown may take half a minute with clients connected).
    pub fn stop(&self) {
        self.run("stop");
    }

    /// Ends the broker with SIGKILL, as a crash would.
    pub fn kill(&self) {
        self.run("kill");
    }

    /// Starts the stopped broker again on its data; returns once it accepts
    /// connections.
    pub fn resume(&self) {
        let bootstrap = self.run("resume");
        assert_eq!(bootstrap, self.bootstrap);
    }

    /// Runs `xtask kafka <action> --port N`; returns the bootstrap it prints.
    fn run(&self, action: &str) -> String {
        let out = Command::new(&self.xtask)
            .args(["kafka", action, "--port", &self.port.to_string()])
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.xtask.display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "xtask kafka {action} --port {} failed ({}):\n{}",
            self.port,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("KAFKA_BOOTSTRAP="))
            .map(str::to_owned)
            .unwrap_or_default()
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        // Best effort: a failure is reported, not raised during a panic.
        let out = Command::new(&self.xtask)
            .args(["kafka", "discard", "--port", &self.port.to_string()])
            .output();
        if let Ok(out) = out
            && !out.status.success()
        {
            tracing::warn!(port = self.port, stderr = %String::from_utf8_lossy(&out.stderr), "discarding the test's own broker failed");
        }
    }
}
