//! `cargo xtask postgres start|stop|status`: a throwaway PostgreSQL server
//! on loopback for the Iceberg SQL catalog tests (the production catalog
//! next to the embedded sqlite one).
//!
//! `start` finds PostgreSQL's server programs (`initdb` on PATH, else
//! `/usr/lib/postgresql/<version>/bin`, as Debian's `postgresql` package
//! installs them), creates a fresh cluster in `<tmp>/tinyflow-postgres-<port>`
//! (trust authentication, loopback only, the socket in the data directory),
//! starts it, waits until it accepts connections and prints
//! `TINYFLOW_POSTGRES_URL=postgres://postgres@127.0.0.1:<port>/postgres` on
//! stdout. PostgreSQL refuses to run as root: as root, the server runs as the
//! `postgres` user (which the package creates) through `runuser`. `stop`
//! stops the server and deletes the cluster. The port is `--port N`, else
//! `$TINYFLOW_POSTGRES_PORT`, else 55432.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{CiServer, CiStop};

const DEFAULT_PORT: u16 = 55_432;
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `cargo xtask postgres <args>`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let (command, port) = parse_args(args)?;
    let server = Server::new(port)?;
    match command.as_str() {
        "start" => {
            server.start()?;
            println!("TINYFLOW_POSTGRES_URL={}", server.url());
            Ok(())
        }
        "stop" => server.stop(),
        "status" => {
            if server.accepts() {
                eprintln!("xtask postgres: running on port {port}");
                Ok(())
            } else {
                bail!("no PostgreSQL server of ours on port {port}")
            }
        }
        other => bail!("unknown command `postgres {other}`; expected start, stop or status"),
    }
}

fn parse_args(args: &[String]) -> Result<(String, u16)> {
    crate::command_and_port(
        args,
        "TINYFLOW_POSTGRES_PORT",
        DEFAULT_PORT,
        "usage: cargo xtask postgres start|stop|status [--port N]",
    )
}

/// One cluster of ours: its data directory and port.
pub(crate) struct Server {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    /// Run the server programs as this user (when we are root).
    run_as: Option<String>,
}

impl Server {
    fn new(port: u16) -> Result<Self> {
        Ok(Server {
            bin: server_bin()?,
            data: std::env::temp_dir().join(format!("tinyflow-postgres-{port}")),
            port,
            run_as: is_root().then(|| "postgres".to_owned()),
        })
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn accepts(&self) -> bool {
        TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, self.port)),
            Duration::from_millis(500),
        )
        .is_ok()
    }

    /// A command running server program `program`, as `run_as` when set.
    fn program(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        match &self.run_as {
            Some(user) => {
                let mut cmd = Command::new("runuser");
                cmd.args(["-u", user, "--"]).arg(path);
                cmd
            }
            None => Command::new(path),
        }
    }

    fn start(&self) -> Result<()> {
        if self.accepts() {
            bail!(
                "port {} is taken (a server of ours still running? `cargo xtask postgres stop --port {}`)",
                self.port,
                self.port
            );
        }
        if self.data.exists() {
            std::fs::remove_dir_all(&self.data)
                .with_context(|| format!("removing the old cluster {}", self.data.display()))?;
        }
        std::fs::create_dir_all(&self.data)
            .with_context(|| format!("creating {}", self.data.display()))?;
        if let Some(user) = &self.run_as {
            let status = Command::new("chown")
                .arg(format!("{user}:"))
                .arg(&self.data)
                .status()
                .context("running chown")?;
            if !status.success() {
                bail!(
                    "chown {user} {} failed ({status}): PostgreSQL does not run as root, and \
                     the `{user}` user (made by Debian's postgresql package) is needed",
                    self.data.display()
                );
            }
        }
        eprintln!(
            "xtask postgres: initdb {} ({})",
            self.data.display(),
            self.bin.display()
        );
        let out = self
            .program("initdb")
            .arg("-D")
            .arg(&self.data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .context("running initdb")?;
        if !out.status.success() {
            bail!(
                "initdb failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.data.display()
        );
        let log = self.data.join("server.log");
        let out = self
            .program("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&log)
            .args(["-o", &options, "-w", "-t", "60", "start"])
            .output()
            .context("running pg_ctl start")?;
        if !out.status.success() {
            bail!(
                "pg_ctl start failed ({}): {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        let started = Instant::now();
        while !self.accepts() {
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "PostgreSQL did not accept connections on port {} within {START_TIMEOUT:?}; its log:\n{}",
                    self.port,
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "xtask postgres: ready on 127.0.0.1:{} after {:.1?}",
            self.port,
            started.elapsed()
        );
        Ok(())
    }

    fn stop(&self) -> Result<()> {
        if !self.data.join("postmaster.pid").exists() {
            eprintln!("xtask postgres: no server of ours on port {}", self.port);
            return Ok(());
        }
        let out = self
            .program("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "stop"])
            .output()
            .context("running pg_ctl stop")?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_dir_all(&self.data)
            .with_context(|| format!("removing {}", self.data.display()))?;
        eprintln!("xtask postgres: stopped, cluster removed");
        Ok(())
    }
}

/// A server for `cargo xtask ci` (see [`CiServer`]).
pub(crate) fn ci_start() -> Result<CiServer<Server>> {
    CiServer::start("postgres", "TINYFLOW_POSTGRES_URL", || {
        let (_, port) = parse_args(&["start".to_owned()])?;
        let server = Server::new(port)?;
        server.start()?;
        Ok((server.url(), server))
    })
}

impl CiStop for Server {
    fn stop_server(&self) -> Result<()> {
        self.stop()
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// The directory of `initdb`, `pg_ctl` and `postgres`.
fn server_bin() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                return Ok(dir);
            }
        }
    }
    // Debian keeps the server programs off PATH, one directory per version.
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|bin| bin.join("initdb").is_file())
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    versions.pop().context(
        "PostgreSQL's server programs (initdb, pg_ctl) are not installed: \
         on Debian/Ubuntu `apt-get install postgresql`",
    )
}
