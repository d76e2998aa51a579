//! Servers that run on the JVM from one artifact on Maven Central, started
//! on loopback for the tests: Apache Iceberg's REST catalog server
//! (`rest.rs`), the S3 server S3Proxy (`s3.rs`) and the identity provider
//! Keycloak (`keycloak.rs`). Each is a [`Spec`]; this file does what they
//! share.
//!
//! `start` resolves the artifact (a jar, or Keycloak's distribution zip) with
//! `mvn` into `target/<command>/libs` unless it is there, prepares `target/<command>/run-<port>/` (the spec's
//! `configure` puts the server's data and settings there), starts `java`
//! from PATH (or the spec's own launcher) in the background in its own
//! process group, waits until an
//! HTTP `GET` of the spec's path answers with the spec's status, writes
//! `server.pid` next to `server.log` and prints `<URL_ENV>=<url>` on
//! stdout. `stop` sends SIGTERM (SIGKILL after 30 s) and deletes the run
//! directory. The port is `--port N`, else the spec's variable, else its
//! default.

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::kafka::{print_tail, run_mvn, signal, spawn_server};
use crate::{CiServer, CiStop};

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

/// One kind of server.
pub(crate) struct Spec {
    /// The xtask command, e.g. `iceberg-rest`.
    pub(crate) command: &'static str,
    /// What it is, for messages: `REST catalog server`.
    pub(crate) what: &'static str,
    /// Maven coordinates of the jar, `group:artifact:version[:type:classifier]`.
    pub(crate) artifact: &'static str,
    /// The artifact's file name as `mvn` copies it.
    pub(crate) jar: &'static str,
    /// How the server is started from the artifact and the run directory;
    /// `None` is `java <JVM_OPTS> -cp <jar> <main class>`.
    pub(crate) launch: Option<fn(artifact: &Path, run_dir: &Path) -> Result<Command>>,
    /// How much the first `mvn` run downloads, for its progress message.
    pub(crate) download: &'static str,
    /// The class `java -cp <jar>` runs. A live pid's command line must
    /// contain it, so a reused pid is not taken for the server (for a
    /// launcher of its own, what that command line contains).
    pub(crate) main_class: &'static str,
    pub(crate) default_port: u16,
    /// The variable that overrides the default port.
    pub(crate) port_env: &'static str,
    /// The variable that carries the server's URL to the tests.
    pub(crate) url_env: &'static str,
    /// What that URL adds to `http://127.0.0.1:<port>` (Keycloak's realm).
    pub(crate) url_path: &'static str,
    /// More `NAME=value` lines `start` and `status` print after the URL's,
    /// and `cargo xtask ci` gives the tests (Keycloak's client).
    pub(crate) env: &'static [(&'static str, &'static str)],
    /// The server is ready when `GET <path>` answers with this status.
    pub(crate) ready: (&'static str, u16),
    /// Prepares the run directory (which exists and is empty) and adds the
    /// server's arguments and environment to `java -cp <jar> <main class>`;
    /// returns a line for the "ready" message.
    pub(crate) configure: fn(run_dir: &Path, port: u16, cmd: &mut Command) -> Result<String>,
}

/// Runs `cargo xtask <spec.command> <args>`.
pub(crate) fn main(spec: &'static Spec, args: &[String]) -> Result<()> {
    let (command, port) = parse_args(spec, args)?;
    let server = Server::new(spec, port)?;
    match command.as_str() {
        "start" => {
            server.start()?;
            println!("{}={}", spec.url_env, server.url());
            for (k, v) in spec.env {
                println!("{k}={v}");
            }
            Ok(())
        }
        "stop" => server.stop(),
        "status" => match server.running_pid()? {
            Some(pid) => {
                eprintln!(
                    "xtask {}: running: pid {pid} on port {port}, {}",
                    spec.command,
                    if server.answers() {
                        "answering"
                    } else {
                        "not answering"
                    }
                );
                println!("{}={}", spec.url_env, server.url());
                for (k, v) in spec.env {
                    println!("{k}={v}");
                }
                Ok(())
            }
            None => bail!("no {} of ours on port {port}", spec.what),
        },
        other => bail!(
            "unknown command `{} {other}`; expected start, stop or status",
            spec.command
        ),
    }
}

fn parse_args(spec: &Spec, args: &[String]) -> Result<(String, u16)> {
    crate::command_and_port(
        args,
        spec.port_env,
        spec.default_port,
        &format!(
            "usage: cargo xtask {} start|stop|status [--port N]",
            spec.command
        ),
    )
}

/// A server for `cargo xtask ci` (see [`CiServer`]).
pub(crate) fn ci_start(spec: &'static Spec) -> Result<CiServer<Server>> {
    CiServer::start(spec.command, spec.url_env, || {
        let (_, port) = parse_args(spec, &["start".to_owned()])?;
        let server = Server::new(spec, port)?;
        server.start()?;
        Ok((server.url(), server))
    })
}

impl CiStop for Server {
    fn stop_server(&self) -> Result<()> {
        self.stop()
    }
}

/// The server of one spec on one port: its jar and run directory.
pub(crate) struct Server {
    spec: &'static Spec,
    port: u16,
    libs: PathBuf,
    run_dir: PathBuf,
}

impl Server {
    fn new(spec: &'static Spec, port: u16) -> Result<Self> {
        let target = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask lies in the workspace root")?
            .join("target")
            .join(spec.command);
        Ok(Server {
            spec,
            port,
            libs: target.join("libs"),
            run_dir: target.join(format!("run-{port}")),
        })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}{}", self.port, self.spec.url_path)
    }

    fn pid_file(&self) -> PathBuf {
        self.run_dir.join("server.pid")
    }

    fn log_file(&self) -> PathBuf {
        self.run_dir.join("server.log")
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
        if self.is_alive(pid) {
            Ok(Some(pid))
        } else {
            let _ = fs::remove_file(self.pid_file());
            Ok(None)
        }
    }

    /// Whether `pid` is a live server of this spec.
    fn is_alive(&self, pid: u32) -> bool {
        let class = self.spec.main_class.as_bytes();
        fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|cmdline| cmdline.windows(class.len()).any(|w| w == class))
    }

    /// Whether `GET <ready path>` answers with the ready status.
    fn answers(&self) -> bool {
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_millis(500))
        else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let (path, status) = self.spec.ready;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.port
        );
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut head = [0_u8; 12];
        stream.read_exact(&mut head).is_ok() && head.ends_with(format!(" {status}").as_bytes())
    }

    fn start(&self) -> Result<()> {
        let (command, what, port) = (self.spec.command, self.spec.what, self.port);
        if let Some(pid) = self.running_pid()? {
            bail!(
                "a {what} of ours already runs on port {port} (pid {pid}); \
                 `cargo xtask {command} stop --port {port}` first"
            );
        }
        if TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            Duration::from_millis(500),
        )
        .is_ok()
        {
            bail!(
                "port {port} is taken by another program; pick another with --port or {}",
                self.spec.port_env
            );
        }
        let jar = self.ensure_jar()?;
        if self.run_dir.exists() {
            fs::remove_dir_all(&self.run_dir)
                .with_context(|| format!("removing the old {}", self.run_dir.display()))?;
        }
        fs::create_dir_all(&self.run_dir)
            .with_context(|| format!("creating {}", self.run_dir.display()))?;
        let log_path = self.log_file();
        let mut cmd = match self.spec.launch {
            Some(launch) => launch(&jar, &self.run_dir)?,
            None => {
                let mut java = Command::new("java");
                java.args(JVM_OPTS)
                    .arg("-cp")
                    .arg(&jar)
                    .arg(self.spec.main_class);
                java
            }
        };
        let serves = (self.spec.configure)(&self.run_dir, port, &mut cmd)?;
        let mut child = spawn_server(cmd, &log_path, &self.pid_file())?;
        let pid = child.id();
        eprintln!(
            "xtask {command}: {what} pid {pid} starting on port {port}, log {}",
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
                    "the {what} did not answer on port {port} ({}); its log is {}",
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
            "xtask {command}: ready at {} after {:.1?} ({serves})",
            self.url(),
            started.elapsed(),
        );
        Ok(())
    }

    /// The server jar, resolved with `mvn` unless already here.
    fn ensure_jar(&self) -> Result<PathBuf> {
        let (command, artifact) = (self.spec.command, self.spec.artifact);
        let jar = self.libs.join(self.spec.jar);
        if jar.is_file() {
            return Ok(jar);
        }
        eprintln!(
            "xtask {command}: resolving {artifact} with mvn into {} (the first run downloads \
             {} into the Maven repository)",
            self.libs.display(),
            self.spec.download
        );
        let started = Instant::now();
        let mut mvn = Command::new("mvn");
        mvn.args(["-B", "-q", COPY])
            .arg(format!("-Dartifact={artifact}"))
            .arg(format!("-DoutputDirectory={}", self.libs.display()))
            .current_dir(std::env::temp_dir());
        let status = run_mvn(mvn)?;
        if !status.success() || !jar.is_file() {
            bail!(
                "mvn could not fetch {artifact} into {} ({status}); its output is above",
                self.libs.display()
            );
        }
        eprintln!(
            "xtask {command}: fetched {} in {:.1?}",
            jar.display(),
            started.elapsed()
        );
        Ok(jar)
    }

    fn stop(&self) -> Result<()> {
        let command = self.spec.command;
        let Some(pid) = self.running_pid()? else {
            eprintln!(
                "xtask {command}: no {} of ours on port {}",
                self.spec.what, self.port
            );
            return Ok(());
        };
        signal(pid, "TERM")?;
        let started = Instant::now();
        while self.is_alive(pid) {
            if started.elapsed() > STOP_TIMEOUT {
                eprintln!("xtask {command}: pid {pid} still runs after {STOP_TIMEOUT:?}: SIGKILL");
                signal(pid, "KILL")?;
                sleep(Duration::from_secs(1));
                break;
            }
            sleep(Duration::from_millis(100));
        }
        fs::remove_dir_all(&self.run_dir)
            .with_context(|| format!("removing {}", self.run_dir.display()))?;
        eprintln!(
            "xtask {command}: pid {pid} stopped after {:.1?}, its data removed",
            started.elapsed()
        );
        Ok(())
    }
}
