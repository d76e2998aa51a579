//! `cargo xtask iceberg-rest start|stop|status [--port N]`: a real Iceberg
//! REST catalog server on loopback for the REST catalog tests.
//!
//! The server is Apache Iceberg's own REST catalog server
//! (`org.apache.iceberg.rest.RESTCatalogServer`, the one behind the
//! `apache/iceberg-rest-fixture` image), from the self-contained
//! `org.apache.iceberg:iceberg-open-api` jar on Maven Central. It serves the
//! REST protocol over a JDBC catalog; here that catalog is a sqlite file and
//! the warehouse a local directory, both in `target/iceberg-rest/run-<port>/`,
//! so the tables it serves can be checked on disk like the SQL catalog's.
//!
//! `start` resolves the jar with `mvn` into `target/iceberg-rest/libs` (about
//! 210 MB the first time), starts the server in the background with `java`
//! from PATH, waits until `GET /v1/config` answers, writes `rest.pid` next to
//! `rest.log` and prints `TINYFLOW_REST_CATALOG_URL=http://127.0.0.1:<port>`
//! on stdout. `stop` sends SIGTERM (SIGKILL after 30 s) and deletes the run
//! directory. The port is `--port N`, else `$TINYFLOW_REST_PORT`, else 8181.

use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::kafka::{forward_to_stderr, print_tail, signal, wait_with_progress};
use crate::{CiServer, CiStop};

const DEFAULT_PORT: u16 = 8181;
const ARTIFACT: &str = "org.apache.iceberg:iceberg-open-api:1.10.0";
const JAR: &str = "iceberg-open-api-1.10.0.jar";
const MAIN_CLASS: &str = "org.apache.iceberg.rest.RESTCatalogServer";
const COPY: &str = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy";
const JVM_OPTS: &[&str] = &[
    "-Xms64m",
    "-Xmx512m",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
];
const START_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(250);

/// Runs `cargo xtask iceberg-rest <args>`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let (command, port) = parse_args(args)?;
    let server = Server::new(port)?;
    match command.as_str() {
        "start" => {
            server.start()?;
            println!("TINYFLOW_REST_CATALOG_URL={}", server.url());
            Ok(())
        }
        "stop" => server.stop(),
        "status" => match server.running_pid()? {
            Some(pid) => {
                eprintln!(
                    "xtask iceberg-rest: running: pid {pid} on port {port}, {}",
                    if server.answers() {
                        "answering"
                    } else {
                        "not answering"
                    }
                );
                println!("TINYFLOW_REST_CATALOG_URL={}", server.url());
                Ok(())
            }
            None => bail!("no REST catalog server of ours on port {port}"),
        },
        other => {
            bail!("unknown command `iceberg-rest {other}`; expected start, stop or status")
        }
    }
}

fn parse_args(args: &[String]) -> Result<(String, u16)> {
    crate::command_and_port(
        args,
        "TINYFLOW_REST_PORT",
        DEFAULT_PORT,
        "usage: cargo xtask iceberg-rest start|stop|status [--port N]",
    )
}

/// The server on one port: its jar and run directory.
pub(crate) struct Server {
    port: u16,
    libs: PathBuf,
    run_dir: PathBuf,
}

impl Server {
    fn new(port: u16) -> Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask lies in the workspace root")?;
        Ok(Server {
            port,
            libs: root.join("target/iceberg-rest/libs"),
            run_dir: root.join(format!("target/iceberg-rest/run-{port}")),
        })
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn pid_file(&self) -> PathBuf {
        self.run_dir.join("rest.pid")
    }

    fn log_file(&self) -> PathBuf {
        self.run_dir.join("rest.log")
    }

    /// The pid of our server when it runs; a stale pid file is removed.
    fn running_pid(&self) -> Result<Option<u32>> {
        let text = match fs::read_to_string(self.pid_file()) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(e).with_context(|| format!("reading {}", self.pid_file().display()));
            }
        };
        let pid: u32 = text
            .trim()
            .parse()
            .with_context(|| format!("{} holds no pid: {text:?}", self.pid_file().display()))?;
        if is_server_alive(pid) {
            Ok(Some(pid))
        } else {
            let _ = fs::remove_file(self.pid_file());
            Ok(None)
        }
    }

    /// Whether `GET /v1/config` answers 200.
    fn answers(&self) -> bool {
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_millis(500))
        else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = format!(
            "GET /v1/config HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.port
        );
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut head = [0_u8; 12];
        stream.read_exact(&mut head).is_ok() && head.ends_with(b" 200")
    }

    fn start(&self) -> Result<()> {
        if let Some(pid) = self.running_pid()? {
            bail!(
                "a REST catalog server of ours already runs on port {} (pid {pid}); \
                 `cargo xtask iceberg-rest stop --port {}` first",
                self.port,
                self.port
            );
        }
        if TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, self.port)),
            Duration::from_millis(500),
        )
        .is_ok()
        {
            bail!(
                "port {} is taken by another program; pick another with --port or TINYFLOW_REST_PORT",
                self.port
            );
        }
        let jar = self.ensure_jar()?;
        if self.run_dir.exists() {
            fs::remove_dir_all(&self.run_dir)
                .with_context(|| format!("removing the old {}", self.run_dir.display()))?;
        }
        let warehouse = self.run_dir.join("warehouse");
        fs::create_dir_all(&warehouse)
            .with_context(|| format!("creating {}", warehouse.display()))?;
        let log_path = self.log_file();
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let mut cmd = Command::new("java");
        // The server turns CATALOG_* variables into catalog properties
        // (`CATALOG_REST_PORT` is `rest.port`); none of the caller's may leak in.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("CATALOG_") {
                cmd.env_remove(name);
            }
        }
        let mut child = cmd
            .args(JVM_OPTS)
            .arg("-cp")
            .arg(&jar)
            .arg(MAIN_CLASS)
            .env(
                "CATALOG_URI",
                format!(
                    "jdbc:sqlite:file:{}",
                    self.run_dir.join("catalog.db").display()
                ),
            )
            .env(
                "CATALOG_WAREHOUSE",
                format!("file://{}", warehouse.display()),
            )
            .env("CATALOG_REST_PORT", self.port.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("duplicating the log file handle")?)
            .stderr(log)
            // Its own process group: a Ctrl-C meant for this command does not
            // reach the server, which outlives this command until `stop`.
            .process_group(0)
            .spawn()
            .context("starting java (is a JDK 17 or newer on PATH?)")?;
        let pid = child.id();
        fs::write(self.pid_file(), format!("{pid}\n"))
            .with_context(|| format!("writing {}", self.pid_file().display()))?;
        eprintln!(
            "xtask iceberg-rest: server pid {pid} starting on port {}, log {}",
            self.port,
            log_path.display()
        );
        let started = Instant::now();
        while !self.answers() {
            let exited = child.try_wait().context("polling the server")?;
            if exited.is_some() || started.elapsed() > START_TIMEOUT {
                print_tail(&log_path);
                let _ = child.kill();
                let _ = child.wait();
                let _ = fs::remove_file(self.pid_file());
                bail!(
                    "the REST catalog server did not answer on port {} ({}); its log is {}",
                    self.port,
                    match exited {
                        Some(status) => format!("it exited: {status}"),
                        None => format!("nothing within {START_TIMEOUT:?}"),
                    },
                    log_path.display()
                );
            }
            sleep(POLL);
        }
        eprintln!(
            "xtask iceberg-rest: ready at {} after {:.1?} (warehouse {})",
            self.url(),
            started.elapsed(),
            warehouse.display()
        );
        Ok(())
    }

    /// The server jar, resolved with `mvn` unless already here.
    fn ensure_jar(&self) -> Result<PathBuf> {
        let jar = self.libs.join(JAR);
        if jar.is_file() {
            return Ok(jar);
        }
        eprintln!(
            "xtask iceberg-rest: resolving {ARTIFACT} with mvn into {} (the first run downloads \
             about 210 MB into the Maven repository)",
            self.libs.display()
        );
        let started = Instant::now();
        let mut child = Command::new("mvn")
            .args(["-B", "-q", COPY])
            .arg(format!("-Dartifact={ARTIFACT}"))
            .arg(format!("-DoutputDirectory={}", self.libs.display()))
            .current_dir(std::env::temp_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running mvn (is Maven on PATH?)")?;
        let forwards = [
            forward_to_stderr(child.stdout.take().context("mvn output pipe")?),
            forward_to_stderr(child.stderr.take().context("mvn error pipe")?),
        ];
        let status = wait_with_progress(child, "mvn")?;
        for forward in forwards {
            let _ = forward.join();
        }
        if !status.success() || !jar.is_file() {
            bail!(
                "mvn could not fetch {ARTIFACT} into {} ({status}); its output is above",
                self.libs.display()
            );
        }
        eprintln!(
            "xtask iceberg-rest: fetched {} in {:.1?}",
            jar.display(),
            started.elapsed()
        );
        Ok(jar)
    }

    fn stop(&self) -> Result<()> {
        let Some(pid) = self.running_pid()? else {
            eprintln!(
                "xtask iceberg-rest: no server of ours on port {}",
                self.port
            );
            return Ok(());
        };
        signal(pid, "TERM")?;
        let started = Instant::now();
        while is_server_alive(pid) {
            if started.elapsed() > STOP_TIMEOUT {
                eprintln!(
                    "xtask iceberg-rest: pid {pid} still runs after {STOP_TIMEOUT:?}: SIGKILL"
                );
                signal(pid, "KILL")?;
                sleep(Duration::from_secs(1));
                break;
            }
            sleep(Duration::from_millis(100));
        }
        fs::remove_dir_all(&self.run_dir)
            .with_context(|| format!("removing {}", self.run_dir.display()))?;
        eprintln!(
            "xtask iceberg-rest: pid {pid} stopped after {:.1?}, its catalog and warehouse removed",
            started.elapsed()
        );
        Ok(())
    }
}

/// Whether `pid` is a live REST catalog server (its command line names the
/// main class, so a reused pid is not taken for it).
fn is_server_alive(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
        cmdline
            .windows(MAIN_CLASS.len())
            .any(|w| w == MAIN_CLASS.as_bytes())
    })
}

/// A server for `cargo xtask ci` (see [`CiServer`]).
pub(crate) fn ci_start() -> Result<CiServer<Server>> {
    CiServer::start("TINYFLOW_REST_CATALOG_URL", || {
        let (_, port) = parse_args(&["start".to_owned()])?;
        let server = Server::new(port)?;
        server.start()?;
        Ok((server.url(), server))
    })
}

impl CiStop for Server {
    const NAME: &'static str = "iceberg-rest";

    fn stop_server(&self) -> Result<()> {
        self.stop()
    }
}
