//! `cargo xtask kafka start|stop|restart|status [--port N]`: a real Apache Kafka broker for integration
//! tests, one KRaft node (broker and controller in one JVM) listening on loopback only. `start`
//! resolves the broker's jars from Maven Central with `mvn` (the assets live in `tools/kafka/`)
//! into a cache that later starts reuse (`target/kafka/libs`, or `$TINYFLOW_KAFKA_HOME`), formats
//! a fresh data directory under `target/kafka/run-<port>/`, starts `kafka.Kafka` in the
//! background with `java` from PATH, waits until the port accepts connections and the broker has
//! logged that it started, writes `kafka.pid` beside its `kafka.log` and prints
//! `KAFKA_BOOTSTRAP=127.0.0.1:<port>` on stdout, the only thing any subcommand prints there, so a
//! script can take it with `out=$(cargo xtask kafka start) && export "$out"`. `stop` sends
//! SIGTERM (SIGKILL after 30 s) to the pid in that file; `restart` stops it and starts it again on
//! the same data directory (topics and records kept: what a broker restart test needs), `kill`
//! ends it with SIGKILL (a crash), `resume` starts a stopped or killed one again on its data,
//! `discard` kills it and deletes its run directory;
//! `status`
//! tells whether that broker runs
//! and exits non-zero when it does not. The port is `--port N`, else `$TINYFLOW_KAFKA_PORT`, else
//! 9092; each port has its own run directory, so brokers on different ports do not meet.
//!
//! Every broker also has a secured listener, SASL_SSL on a free port, as managed Kafka services
//! offer: a CA and the broker's certificate (for 127.0.0.1 and localhost) are made with the JDK's
//! `keytool` when the data directory is formatted, and the SCRAM-SHA-256/512 user
//! [`SASL_USER`] is created then (PLAIN takes it too). `start --secured` also prints
//! `KAFKA_SASL_SSL_BOOTSTRAP=`, `KAFKA_SSL_CA=` (the CA's PEM file), `KAFKA_SASL_USERNAME=` and
//! `KAFKA_SASL_PASSWORD=` lines, which `run-<port>/secured.env` holds as well.
//!
//! With `--oidc-issuer URL` (or `$TINYFLOW_OIDC_ISSUER`) when the data directory is formatted,
//! the secured listener takes OAUTHBEARER too and checks tokens as a broker behind an OpenID
//! Connect provider does: signed by a key the issuer publishes (`<URL>/protocol/openid-connect/certs`,
//! Keycloak's layout; see `keycloak.rs`), issued by `URL`, for the audience `kafka`.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, ErrorKind};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

const DEFAULT_PORT: u16 = 9092;
/// The test user of the secured listener (SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN).
pub(crate) const SASL_USER: &str = "tinyflow";
/// Its password: a loopback broker for tests, so a fixed one.
const SASL_PASSWORD: &str = "tinyflow-test-secret";
/// The password of the broker's and the CA's PKCS12 stores.
const KEYSTORE_PASSWORD: &str = "tinyflow-keystore";
/// The secured listener's settings for clients, written at format time.
const SECURED_ENV: &str = "secured.env";
/// Fully qualified, so `mvn` needs no plugin-prefix lookup and the version is pinned.
const COPY_DEPENDENCIES: &str =
    "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies";
/// JVM options of the broker: a small heap is plenty for tests, and an out-of-memory error
/// ends the process (and so shows in the log) rather than leaving a half-working broker.
const BROKER_JVM_OPTS: &[&str] = &[
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
];
/// JVM options of the short-lived storage tool that formats the data directory.
const TOOL_JVM_OPTS: &[&str] = &["-Xmx256m", "-Djava.awt.headless=true"];
/// The line `kafka.server.KafkaRaftServer` logs once broker and controller are up.
const STARTED_MARKER: &str = "Kafka Server started";
/// A copy of the pom.xml a jar cache was resolved from: the cache is reused while it matches.
const CACHE_STAMP: &str = ".resolved-from-pom.xml";
const START_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(250);
const LOG_TAIL_LINES: usize = 60;

/// Runs `cargo xtask kafka <args>`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let (action, port, oidc) = parse_args(args, std::env::var("TINYFLOW_KAFKA_PORT").ok())?;
    let layout = Layout::new(port)?;
    // The identity provider whose tokens a freshly formatted broker takes:
    // `--oidc-issuer URL`, else `$TINYFLOW_OIDC_ISSUER`, else none.
    let oidc = oidc.or_else(|| {
        std::env::var("TINYFLOW_OIDC_ISSUER")
            .ok()
            .filter(|url| !url.is_empty())
    });
    let oidc = oidc.as_deref();
    match action {
        Action::Start => {
            start(&layout, Data::Fresh, oidc)?;
            if args.iter().any(|a| a == "--secured") {
                for (k, v) in secured_env(&layout)? {
                    println!("{k}={v}");
                }
            }
            Ok(())
        }
        Action::Stop => stop(&layout),
        Action::Restart => {
            stop(&layout)?;
            start(&layout, Data::Keep, oidc)
        }
        Action::Resume => start(&layout, Data::Keep, oidc),
        Action::Kill => kill(&layout),
        Action::Discard => {
            if matches!(broker_state(&layout)?, BrokerState::Running(_)) {
                kill(&layout)?;
            }
            if layout.run_dir.exists() {
                fs::remove_dir_all(&layout.run_dir)
                    .with_context(|| format!("removing {}", layout.run_dir.display()))?;
            }
            Ok(())
        }
        Action::Status => status(&layout),
    }
}

/// A broker for `cargo xtask ci`: started unless one of ours already runs
/// (or `KAFKA_BOOTSTRAP` names another), and stopped on drop if this call
/// started it.
pub(crate) struct CiBroker {
    layout: Option<Layout>,
    /// `host:port` for the tests' `KAFKA_BOOTSTRAP`.
    pub(crate) bootstrap: String,
    /// The secured listener's variables for the tests (`KAFKA_SASL_SSL_BOOTSTRAP`, ...); empty
    /// for a broker `KAFKA_BOOTSTRAP` names, whose tests take them from the environment.
    pub(crate) secured: Vec<(String, String)>,
}

impl CiBroker {
    /// `oidc_issuer`: the identity provider whose tokens the secured listener takes.
    pub(crate) fn start(oidc_issuer: &str) -> Result<Self> {
        if let Ok(given) = std::env::var("KAFKA_BOOTSTRAP") {
            eprintln!("xtask kafka: using the broker at KAFKA_BOOTSTRAP={given}");
            return Ok(CiBroker {
                layout: None,
                bootstrap: given,
                secured: Vec::new(),
            });
        }
        let (_, port, _) = parse_args(
            &["start".to_owned()],
            std::env::var("TINYFLOW_KAFKA_PORT").ok(),
        )?;
        let layout = Layout::new(port)?;
        let ours = !matches!(broker_state(&layout)?, BrokerState::Running(_));
        start(&layout, Data::Fresh, Some(oidc_issuer))?;
        let bootstrap = layout.address().to_string();
        let secured = secured_env(&layout)?;
        Ok(CiBroker {
            layout: ours.then_some(layout),
            bootstrap,
            secured,
        })
    }
}

impl Drop for CiBroker {
    fn drop(&mut self) {
        if let Some(layout) = &self.layout
            && let Err(e) = stop(layout)
        {
            eprintln!("xtask kafka: stopping the broker failed: {e:#}");
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Start,
    Stop,
    /// Stop, then start on the same data (topics and records kept).
    Restart,
    /// Start on the data a stopped broker left (topics and records kept).
    Resume,
    /// SIGKILL: a broker crash, without the controlled shutdown.
    Kill,
    /// Kill if running, then delete the run directory (a test's broker).
    Discard,
    Status,
}

/// The action, the port and `--oidc-issuer`'s URL, if given.
fn parse_args(args: &[String], env_port: Option<String>) -> Result<(Action, u16, Option<String>)> {
    let usage = "usage: cargo xtask kafka <start|stop|kill|restart|resume|discard|status> [--port N] [--secured] [--oidc-issuer URL]";
    let action = match args.first().map(String::as_str) {
        Some("start") => Action::Start,
        Some("stop") => Action::Stop,
        Some("restart") => Action::Restart,
        Some("resume") => Action::Resume,
        Some("kill") => Action::Kill,
        Some("discard") => Action::Discard,
        Some("status") => Action::Status,
        other => bail!("unknown or missing kafka command {other:?}; {usage}"),
    };
    let (mut port_text, mut oidc_issuer) = (None, None);
    let mut rest = args[1..].iter().filter(|a| *a != "--secured");
    while let Some(arg) = rest.next() {
        if arg == "--oidc-issuer" {
            oidc_issuer = Some(rest.next().context("--oidc-issuer needs a URL")?.clone());
        } else if let Some(url) = arg.strip_prefix("--oidc-issuer=") {
            oidc_issuer = Some(url.to_owned());
        } else if arg == "--port" {
            port_text = Some(rest.next().context("--port needs a value")?.clone());
        } else if let Some(value) = arg.strip_prefix("--port=") {
            port_text = Some(value.to_owned());
        } else {
            bail!("unexpected argument {arg:?}; {usage}");
        }
    }
    let port = match port_text.or(env_port) {
        Some(text) => match text.trim().parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => bail!("invalid Kafka port {text:?}: expected 1-65535"),
        },
        None => DEFAULT_PORT,
    };
    Ok((action, port, oidc_issuer))
}

/// What the secured listener needs to take OAUTHBEARER tokens of `issuer`;
/// appended to `server.properties` (a later line wins over an earlier one).
fn oidc_properties(issuer: &str) -> String {
    let issuer = issuer.trim_end_matches('/');
    format!(
        "\n# OAUTHBEARER with tokens of the OpenID Connect provider {issuer} (--oidc-issuer)\n\
         sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512,PLAIN,OAUTHBEARER\n\
         listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;\n\
         listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler\n\
         {JWKS_KEY}={issuer}/protocol/openid-connect/certs\n\
         sasl.oauthbearer.expected.issuer={issuer}\n\
         sasl.oauthbearer.expected.audience={OIDC_AUDIENCE}\n\
         # Clients log in again every 10 s, so a client that does not renew its token in time\n\
         # (Keycloak's last 20 s) loses its connections.\n\
         listener.name.sasl_ssl.oauthbearer.connections.max.reauth.ms=10000\n"
    )
}

/// Where the broker fetches the keys tokens are checked with.
const JWKS_KEY: &str = "sasl.oauthbearer.jwks.endpoint.url";
/// The audience tokens must carry (Keycloak's realm adds it; `keycloak.rs`).
const OIDC_AUDIENCE: &str = crate::keycloak::AUDIENCE;

/// The JVM option that lets the broker fetch the keys named in
/// `properties` (Kafka 4 refuses any URL not listed in it), if any.
fn allowed_urls_option(properties: &str) -> Option<String> {
    properties
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(JWKS_KEY)?.strip_prefix('='))
        .map(|url| {
            format!(
                "-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls={}",
                url.trim()
            )
        })
}

/// Where everything of the broker on one port lives.
#[derive(Debug)]
struct Layout {
    port: u16,
    /// `tools/kafka/`: pom.xml, server.properties.in, log4j2.properties.
    assets: PathBuf,
    /// The jar cache.
    libs: PathBuf,
    /// `target/kafka/run-<port>/`: server.properties, data/, kafka.log, kafka.pid.
    run_dir: PathBuf,
}

impl Layout {
    fn new(port: u16) -> Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask lies in the workspace root")?;
        let libs = match std::env::var_os("TINYFLOW_KAFKA_HOME") {
            Some(dir) if !dir.is_empty() => std::path::absolute(&dir)
                .with_context(|| format!("resolving TINYFLOW_KAFKA_HOME {dir:?}"))?,
            _ => root.join("target/kafka/libs"),
        };
        Ok(Self {
            port,
            assets: root.join("tools/kafka"),
            libs,
            run_dir: root.join(format!("target/kafka/run-{port}")),
        })
    }

    fn pid_file(&self) -> PathBuf {
        self.run_dir.join("kafka.pid")
    }

    fn log_file(&self) -> PathBuf {
        self.run_dir.join("kafka.log")
    }

    fn address(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    fn print_bootstrap(&self) {
        println!("KAFKA_BOOTSTRAP={}", self.address());
    }
}

/// Whether a start begins with an empty broker or the data of the last run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Data {
    Fresh,
    Keep,
}

fn start(layout: &Layout, data: Data, oidc: Option<&str>) -> Result<()> {
    match broker_state(layout)? {
        BrokerState::Running(pid) => {
            eprintln!(
                "xtask kafka: a broker started by xtask is already running on {} (pid {pid}, log {})",
                layout.address(),
                layout.log_file().display()
            );
            layout.print_bootstrap();
            return Ok(());
        }
        BrokerState::Stale(pid) => eprintln!(
            "xtask kafka: pid {pid} in {} is no longer a running broker; starting afresh",
            layout.pid_file().display()
        ),
        BrokerState::Absent => {}
    }
    if let Err(err) = TcpListener::bind(layout.address()) {
        bail!(
            "{} is already in use ({err}), and not by a broker started by xtask; \
             stop that process or pick another port with --port or TINYFLOW_KAFKA_PORT",
            layout.address()
        );
    }

    let started = Instant::now();
    let libs = ensure_jars(layout)?;
    let classpath = format!("{}/*", libs.display());
    let log4j = format!(
        "-Dlog4j2.configurationFile={}",
        layout.assets.join("log4j2.properties").display()
    );

    let properties_path = layout.run_dir.join("server.properties");
    if data == Data::Keep && properties_path.exists() {
        eprintln!(
            "xtask kafka: restarting on the data in {}",
            layout.run_dir.display()
        );
    } else {
        format_data_dir(layout, &classpath, &log4j, oidc)?;
    }
    let log_path = layout.log_file();
    let properties = fs::read_to_string(&properties_path)
        .with_context(|| format!("reading {}", properties_path.display()))?;
    let mut java = Command::new("java");
    java.arg("-cp")
        .arg(&classpath)
        .args(BROKER_JVM_OPTS)
        .args(allowed_urls_option(&properties))
        .arg(&log4j)
        .arg("kafka.Kafka")
        .arg(&properties_path);
    let mut child = spawn_server(java, &log_path, &layout.pid_file())?;
    let pid = child.id();
    eprintln!(
        "xtask kafka: broker pid {pid} starting on {}, log {}",
        layout.address(),
        log_path.display()
    );

    if let Err(err) = wait_until_started(layout, &mut child) {
        print_tail(&log_path);
        // Best effort: the broker may already have exited, which is what the error says.
        let _ = child.kill();
        let _ = child.wait();
        let _ = fs::remove_file(layout.pid_file());
        return Err(err.context(format!(
            "the Kafka broker did not start; its log is {}",
            log_path.display()
        )));
    }
    eprintln!(
        "xtask kafka: broker pid {pid} ready on {} after {:.1} s (stop it with `cargo xtask kafka stop{}`)",
        layout.address(),
        started.elapsed().as_secs_f64(),
        if layout.port == DEFAULT_PORT {
            String::new()
        } else {
            format!(" --port {}", layout.port)
        }
    );
    layout.print_bootstrap();
    Ok(())
}

/// A fresh run directory: rendered `server.properties` and a formatted,
/// empty data directory.
fn format_data_dir(
    layout: &Layout,
    classpath: &str,
    log4j: &str,
    oidc: Option<&str>,
) -> Result<()> {
    if layout.run_dir.exists() {
        fs::remove_dir_all(&layout.run_dir)
            .with_context(|| format!("removing old {}", layout.run_dir.display()))?;
    }
    let data_dir = layout.run_dir.join("data");
    fs::create_dir_all(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let controller_port = free_port()?;
    let sasl_ssl_port = free_port()?;
    let (keystore, ca) = make_certificates(&layout.run_dir)?;
    let template_path = layout.assets.join("server.properties.in");
    let template = fs::read_to_string(&template_path)
        .with_context(|| format!("reading {}", template_path.display()))?;
    let data = data_dir
        .to_str()
        .context("the Kafka data directory path is not UTF-8")?;
    let keystore_text = keystore
        .to_str()
        .context("the run directory path is not UTF-8")?;
    let mut properties = render_properties(
        &template,
        &[
            ("PORT", layout.port.to_string()),
            ("CONTROLLER_PORT", controller_port.to_string()),
            ("SASL_SSL_PORT", sasl_ssl_port.to_string()),
            ("DATA", data.to_owned()),
            ("KEYSTORE", keystore_text.to_owned()),
            ("KEYSTORE_PASSWORD", KEYSTORE_PASSWORD.to_owned()),
            ("SASL_USER", SASL_USER.to_owned()),
            ("SASL_PASSWORD", SASL_PASSWORD.to_owned()),
        ],
    )?;
    let env = [
        (
            "KAFKA_SASL_SSL_BOOTSTRAP",
            format!("127.0.0.1:{sasl_ssl_port}"),
        ),
        ("KAFKA_SSL_CA", ca.display().to_string()),
        ("KAFKA_SASL_USERNAME", SASL_USER.to_owned()),
        ("KAFKA_SASL_PASSWORD", SASL_PASSWORD.to_owned()),
    ]
    .iter()
    .map(|(k, v)| format!("{k}={v}\n"))
    .collect::<String>();
    if let Some(issuer) = oidc {
        eprintln!("xtask kafka: the SASL_SSL listener takes OAUTHBEARER tokens of {issuer}");
        properties.push_str(&oidc_properties(issuer));
    }
    let env_path = layout.run_dir.join(SECURED_ENV);
    fs::write(&env_path, env).with_context(|| format!("writing {}", env_path.display()))?;
    let properties_path = layout.run_dir.join("server.properties");
    fs::write(&properties_path, properties)
        .with_context(|| format!("writing {}", properties_path.display()))?;

    let cluster_id = cluster_id(layout.port);
    eprintln!(
        "xtask kafka: formatting {} (cluster id {cluster_id})",
        data_dir.display()
    );
    let format_log = layout.run_dir.join("format.log");
    let output = Command::new("java")
        .arg("-cp")
        .arg(classpath)
        .args(TOOL_JVM_OPTS)
        .arg(log4j)
        .args(["kafka.tools.StorageTool", "format", "--standalone"])
        .args(["--add-scram", &scram("SCRAM-SHA-256")])
        .args(["--add-scram", &scram("SCRAM-SHA-512")])
        .args(["--cluster-id", &cluster_id, "--config"])
        .arg(&properties_path)
        .stdin(Stdio::null())
        .output()
        .context("running java (is a JDK 17 or newer on PATH?)")?;
    fs::write(&format_log, [output.stdout, output.stderr].concat())
        .with_context(|| format!("writing {}", format_log.display()))?;
    if !output.status.success() {
        print_tail(&format_log);
        bail!(
            "formatting the Kafka data directory failed ({}); see {}",
            output.status,
            format_log.display()
        );
    }

    Ok(())
}

/// Waits until the broker's port accepts connections and its log says it started; fails if it
/// exits first or takes longer than [`START_TIMEOUT`].
fn wait_until_started(layout: &Layout, child: &mut Child) -> Result<()> {
    let started = Instant::now();
    let mut next_progress = PROGRESS_EVERY;
    loop {
        if let Some(status) = child.try_wait().context("checking on the broker")? {
            bail!("the broker exited during startup ({status})");
        }
        let log = read_lossy(&layout.log_file());
        let logged = log.contains(STARTED_MARKER);
        let listening = TcpStream::connect_timeout(&layout.address(), POLL).is_ok();
        if logged && listening {
            return Ok(());
        }
        let elapsed = started.elapsed();
        if elapsed >= START_TIMEOUT {
            bail!(
                "timed out after {} s: port {} {}, {:?} {}",
                START_TIMEOUT.as_secs(),
                layout.port,
                if listening { "open" } else { "closed" },
                STARTED_MARKER,
                if logged { "logged" } else { "not logged" },
            );
        }
        if elapsed >= next_progress {
            next_progress += PROGRESS_EVERY;
            let last = log.lines().last().unwrap_or("");
            eprintln!(
                "xtask kafka: waiting for the broker ({} s): port {}; last log line: {}",
                elapsed.as_secs(),
                if listening { "open" } else { "closed" },
                last.chars().take(120).collect::<String>()
            );
        }
        sleep(POLL);
    }
}

fn stop(layout: &Layout) -> Result<()> {
    let pid = match broker_state(layout)? {
        BrokerState::Absent => {
            eprintln!(
                "xtask kafka: no broker started by xtask on port {} (no {})",
                layout.port,
                layout.pid_file().display()
            );
            return Ok(());
        }
        BrokerState::Stale(pid) => {
            remove_pid_file(layout)?;
            eprintln!(
                "xtask kafka: pid {pid} on port {} is no longer a running broker; removed the stale pid file",
                layout.port
            );
            return Ok(());
        }
        BrokerState::Running(pid) => pid,
    };
    let started = Instant::now();
    eprintln!(
        "xtask kafka: stopping broker pid {pid} on port {} (SIGTERM)",
        layout.port
    );
    signal(pid, "TERM")?;
    if !wait_for_exit(pid, STOP_TIMEOUT) {
        eprintln!(
            "xtask kafka: broker pid {pid} still running after {} s: SIGKILL",
            STOP_TIMEOUT.as_secs()
        );
        signal(pid, "KILL")?;
        if !wait_for_exit(pid, KILL_TIMEOUT) {
            bail!("broker pid {pid} survived SIGKILL; pid file left in place");
        }
    }
    remove_pid_file(layout)?;
    eprintln!(
        "xtask kafka: broker pid {pid} stopped after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Ends the broker with SIGKILL, as a crash would.
fn kill(layout: &Layout) -> Result<()> {
    let BrokerState::Running(pid) = broker_state(layout)? else {
        bail!("no broker started by xtask runs on port {}", layout.port);
    };
    signal(pid, "KILL")?;
    if !wait_for_exit(pid, KILL_TIMEOUT) {
        bail!("broker pid {pid} survived SIGKILL; pid file left in place");
    }
    remove_pid_file(layout)?;
    eprintln!(
        "xtask kafka: broker pid {pid} on port {} killed",
        layout.port
    );
    Ok(())
}

fn status(layout: &Layout) -> Result<()> {
    match broker_state(layout)? {
        BrokerState::Running(pid) => {
            let listening = TcpStream::connect_timeout(&layout.address(), POLL).is_ok();
            eprintln!(
                "xtask kafka: running: pid {pid} on {} (port {}), log {}",
                layout.address(),
                if listening {
                    "accepting connections"
                } else {
                    "not accepting connections"
                },
                layout.log_file().display()
            );
            layout.print_bootstrap();
            return Ok(());
        }
        BrokerState::Stale(pid) => eprintln!(
            "xtask kafka: not running on port {}: pid {pid} in {} is no longer a running broker",
            layout.port,
            layout.pid_file().display()
        ),
        BrokerState::Absent => eprintln!(
            "xtask kafka: not running on port {} (no broker started by xtask)",
            layout.port
        ),
    }
    // "Not running" is an answer, not a failure: no error report, only the exit code a script
    // tests (`cargo xtask kafka status && ...`).
    std::process::exit(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BrokerState {
    /// No pid file.
    Absent,
    /// A pid file whose process is gone (or is no longer a Kafka broker).
    Stale(u32),
    /// A pid file whose process is our broker.
    Running(u32),
}

fn broker_state(layout: &Layout) -> Result<BrokerState> {
    let path = layout.pid_file();
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(BrokerState::Absent),
        Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
    };
    let pid: u32 = text
        .trim()
        .parse()
        .with_context(|| format!("{} holds no pid: {text:?}", path.display()))?;
    Ok(if is_broker_alive(pid) {
        BrokerState::Running(pid)
    } else {
        BrokerState::Stale(pid)
    })
}

/// Whether `pid` is a live Kafka broker. On Linux its command line must name `kafka.Kafka`, so
/// a pid reused by another process after a reboot is not taken for the broker (nor signalled),
/// and an exited but unreaped broker (a zombie, whose command line is empty) counts as gone.
fn is_broker_alive(pid: u32) -> bool {
    if Path::new("/proc/self").exists() {
        fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|cmdline| cmdline.windows(11).any(|w| w == b"kafka.Kafka"))
    } else {
        signal(pid, "0").is_ok()
    }
}

/// Sends `signal` (a name such as TERM, or 0 to probe) with the `kill` command, which keeps
/// this crate free of libc and unsafe code.
pub(crate) fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .context("running kill")?;
    if !status.success() {
        bail!("kill -{signal} {pid} failed ({status})");
    }
    Ok(())
}

/// Polls until `pid` is no longer a live broker; false if it still is after `timeout`.
fn wait_for_exit(pid: u32, timeout: Duration) -> bool {
    let started = Instant::now();
    let mut next_progress = PROGRESS_EVERY;
    while is_broker_alive(pid) {
        let elapsed = started.elapsed();
        if elapsed >= timeout {
            return false;
        }
        if elapsed >= next_progress {
            next_progress += PROGRESS_EVERY;
            eprintln!(
                "xtask kafka: waiting for pid {pid} to exit ({} s)",
                elapsed.as_secs()
            );
        }
        sleep(Duration::from_millis(100));
    }
    true
}

fn remove_pid_file(layout: &Layout) -> Result<()> {
    match fs::remove_file(layout.pid_file()) {
        Err(err) if err.kind() != ErrorKind::NotFound => {
            Err(err).with_context(|| format!("removing {}", layout.pid_file().display()))
        }
        _ => Ok(()),
    }
}

/// Returns the jar directory, resolving it with `mvn` first unless it already holds the jars
/// of the current `tools/kafka/pom.xml`.
fn ensure_jars(layout: &Layout) -> Result<PathBuf> {
    let pom_path = layout.assets.join("pom.xml");
    let pom =
        fs::read_to_string(&pom_path).with_context(|| format!("reading {}", pom_path.display()))?;
    let libs = &layout.libs;
    if cache_matches(libs, &pom) {
        eprintln!("xtask kafka: using the Kafka jars in {}", libs.display());
        return Ok(libs.clone());
    }
    let foreign = libs.exists()
        && !libs.join(CACHE_STAMP).exists()
        && fs::read_dir(libs)
            .with_context(|| format!("listing {}", libs.display()))?
            .next()
            .is_some();
    if foreign {
        bail!(
            "{} is not empty and was not filled by xtask (no {CACHE_STAMP}); \
             empty it or point TINYFLOW_KAFKA_HOME at another directory",
            libs.display()
        );
    }
    let name = libs
        .file_name()
        .context("the Kafka jar directory needs a name")?
        .to_string_lossy();
    let partial = libs.with_file_name(format!("{name}.partial-{}", std::process::id()));
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    eprintln!(
        "xtask kafka: resolving the Kafka jars with mvn into {} (the first run downloads ~60 MB \
         into the Maven repository, usually under a minute)",
        libs.display()
    );
    let started = Instant::now();
    let mut mvn = Command::new("mvn");
    mvn.args(["-B", "-q", "-f"])
        .arg(&pom_path)
        .args([COPY_DEPENDENCIES, "-DincludeScope=runtime"])
        .arg(format!("-DoutputDirectory={}", partial.display()));
    let status = run_mvn(mvn)?;
    if !status.success() {
        let _ = fs::remove_dir_all(&partial);
        bail!("mvn could not resolve the Kafka jars ({status}); its output is above");
    }
    if !has_broker_jar(&partial) {
        bail!(
            "mvn succeeded but left no kafka_2.13-*.jar in {}",
            partial.display()
        );
    }
    fs::write(partial.join(CACHE_STAMP), &pom)
        .with_context(|| format!("writing {}", partial.join(CACHE_STAMP).display()))?;
    if libs.exists() {
        fs::remove_dir_all(libs).with_context(|| format!("removing old {}", libs.display()))?;
    }
    if let Err(err) = fs::rename(&partial, libs) {
        // Another start may have filled the cache meanwhile; its copy is as good as ours.
        let _ = fs::remove_dir_all(&partial);
        if !cache_matches(libs, &pom) {
            return Err(err).with_context(|| format!("moving the jars into {}", libs.display()));
        }
    }
    let bytes: u64 = fs::read_dir(libs)
        .with_context(|| format!("listing {}", libs.display()))?
        .filter_map(|entry| entry.ok()?.metadata().ok())
        .map(|meta| meta.len())
        .sum();
    eprintln!(
        "xtask kafka: resolved the jars in {:.1} s ({:.1} MB in {})",
        started.elapsed().as_secs_f64(),
        bytes as f64 / 1e6,
        libs.display()
    );
    Ok(libs.clone())
}

fn cache_matches(libs: &Path, pom: &str) -> bool {
    fs::read_to_string(libs.join(CACHE_STAMP)).is_ok_and(|stamp| stamp == pom)
        && has_broker_jar(libs)
}

fn has_broker_jar(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|entries| {
        entries.filter_map(Result::ok).any(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with("kafka_2.13-") && name.ends_with(".jar")
        })
    })
}

/// Starts the `java` server set up in `java`, its output in a new `log_path`, in a process group
/// of its own, and writes its pid to `pid_file`.
pub(crate) fn spawn_server(mut java: Command, log_path: &Path, pid_file: &Path) -> Result<Child> {
    let log = File::create(log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let child = java
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the log file handle")?)
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this command (or a later one in the same
        // terminal) does not reach the server, which outlives this command until `stop`.
        .process_group(0)
        .spawn()
        .context("starting java (is a JDK 17 or newer on PATH?)")?;
    fs::write(pid_file, format!("{}\n", child.id()))
        .with_context(|| format!("writing {}", pid_file.display()))?;
    Ok(child)
}

/// Runs `mvn` with its output on our stderr and progress while it works. Our stdout carries
/// only what the commands print for scripts (`KAFKA_BOOTSTRAP=...`), so Maven's messages go to
/// stderr, with the colour resets that Debian's Maven 3.8 prints on both streams even in batch mode.
pub(crate) fn run_mvn(mut mvn: Command) -> Result<ExitStatus> {
    let mut child = mvn
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
        // The pipes close when mvn exits, so these end promptly; a panic there lost only output.
        let _ = forward.join();
    }
    Ok(status)
}

/// Copies a child's output to our stderr line by line, without ANSI colour resets.
pub(crate) fn forward_to_stderr(
    output: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(output).split(b'\n').map_while(Result::ok) {
            let line = String::from_utf8_lossy(&line).replace("\x1b[0m", "");
            if !line.trim().is_empty() {
                eprintln!("{line}");
            }
        }
    })
}

/// Waits for `child`, saying every few seconds that it still runs.
pub(crate) fn wait_with_progress(mut child: Child, what: &str) -> Result<ExitStatus> {
    let started = Instant::now();
    let mut next_progress = PROGRESS_EVERY;
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for {what}"))?
        {
            return Ok(status);
        }
        if started.elapsed() >= next_progress {
            next_progress += PROGRESS_EVERY;
            eprintln!(
                "xtask: {what} still running ({} s)",
                started.elapsed().as_secs()
            );
        }
        sleep(POLL);
    }
}

/// Fills in server.properties.in; fails if a placeholder is left.
fn render_properties(template: &str, values: &[(&str, String)]) -> Result<String> {
    let mut rendered = template.to_owned();
    for (name, value) in values {
        rendered = rendered.replace(&format!("@{name}@"), value);
    }
    if let Some(line) = rendered
        .lines()
        .find(|line| !line.trim_start().starts_with('#') && line.contains('@'))
    {
        bail!("server.properties.in has a placeholder xtask does not fill: {line:?}");
    }
    Ok(rendered)
}

/// The storage tool's argument that creates the test user for `mechanism`.
fn scram(mechanism: &str) -> String {
    format!("{mechanism}=[name={SASL_USER},password={SASL_PASSWORD}]")
}

/// The secured listener's variables, from the run directory.
fn secured_env(layout: &Layout) -> Result<Vec<(String, String)>> {
    let path = layout.run_dir.join(SECURED_ENV);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// A CA and a broker certificate it signs (for 127.0.0.1 and localhost), made with the JDK's
/// `keytool` in `dir`: the broker's PKCS12 keystore and the CA's PEM file for clients.
fn make_certificates(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let ca_pem = dir.join("ca.pem");
    let keystore = dir.join("broker.p12");
    let text = dir
        .to_str()
        .context("the run directory's path is not UTF-8")?;
    if text.contains(char::is_whitespace) {
        bail!(
            "the run directory's path {text:?} has a space, which keytool's arguments here cannot take"
        );
    }
    // One keytool call a line; `{d}` is the run directory.
    let steps = [
        // The CA.
        "-genkeypair -alias ca -keyalg RSA -keysize 2048 -validity 3650 -dname CN=tinyflow-test-CA -ext bc:c -storetype PKCS12 -keystore {d}/ca.p12",
        "-exportcert -rfc -alias ca -keystore {d}/ca.p12 -file {d}/ca.pem",
        // The broker's key, and its certificate for 127.0.0.1 and localhost, signed by the CA.
        "-genkeypair -alias broker -keyalg RSA -keysize 2048 -validity 3650 -dname CN=localhost -ext SAN=ip:127.0.0.1,dns:localhost -storetype PKCS12 -keystore {d}/broker.p12",
        "-certreq -alias broker -keystore {d}/broker.p12 -file {d}/broker.csr",
        "-gencert -alias ca -keystore {d}/ca.p12 -infile {d}/broker.csr -outfile {d}/broker.pem -rfc -validity 3650 -ext SAN=ip:127.0.0.1,dns:localhost",
        // The chain into the broker's keystore.
        "-importcert -noprompt -alias ca -file {d}/ca.pem -keystore {d}/broker.p12",
        "-importcert -noprompt -alias broker -file {d}/broker.pem -keystore {d}/broker.p12",
    ];
    for step in steps {
        let step = step.replace("{d}", text);
        let output = Command::new("keytool")
            .args(step.split_whitespace())
            .args(["-storepass", KEYSTORE_PASSWORD])
            .stdin(Stdio::null())
            .output()
            .context("running keytool (the JDK's; is a JDK on PATH?)")?;
        if !output.status.success() {
            bail!(
                "keytool {step} failed ({}): {}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
    Ok((keystore, ca_pem))
}

/// A free loopback port for the controller listener, which no client uses.
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free port")?;
    Ok(listener
        .local_addr()
        .context("reading a bound port")?
        .port())
}

/// A Kafka cluster id: 16 bytes in unpadded URL-safe base64, as `kafka-storage random-uuid`
/// prints, made here to save a JVM start. Unique enough for a data directory that lives for one
/// run: the time in nanoseconds, our pid and the port.
fn cluster_id(port: u16) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    let mixed =
        nanos ^ (u128::from(std::process::id()) << 64) ^ (u128::from(port) << 96) ^ (1 << 126);
    let mut bytes = mixed.to_be_bytes();
    // The first character comes from the top six bits: keep it a letter, never '-' (which the
    // command line would read as an option) or '_'.
    bytes[0] &= 0x7f;
    base64_url(&bytes)
}

/// Unpadded URL-safe base64 (RFC 4648 section 5), the form of Kafka's `Uuid::toString`.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let mut group = [0u8; 3];
        group[..chunk.len()].copy_from_slice(chunk);
        let n = u32::from(group[0]) << 16 | u32::from(group[1]) << 8 | u32::from(group[2]);
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
        }
    }
    out
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Prints the last lines of a log on stderr.
pub(crate) fn print_tail(path: &Path) {
    let text = read_lossy(path);
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(LOG_TAIL_LINES);
    eprintln!(
        "xtask: ---- last {} lines of {} ----",
        lines.len() - from,
        path.display()
    );
    for line in &lines[from..] {
        eprintln!("{line}");
    }
    eprintln!("xtask: ---- end of {} ----", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn port_comes_from_flag_then_env_then_default() {
        assert_eq!(
            parse_args(&args(&["start"]), None).unwrap(),
            (Action::Start, 9092, None)
        );
        assert_eq!(
            parse_args(&args(&["stop"]), Some("19092".into())).unwrap(),
            (Action::Stop, 19092, None)
        );
        assert_eq!(
            parse_args(&args(&["status", "--port", "29092"]), Some("19092".into())).unwrap(),
            (Action::Status, 29092, None)
        );
        assert_eq!(
            parse_args(&args(&["start", "--port=39092"]), None).unwrap(),
            (Action::Start, 39092, None)
        );
        assert!(parse_args(&args(&["start", "--port", "0"]), None).is_err());
        assert!(parse_args(&args(&["start", "--port"]), None).is_err());
        assert!(parse_args(&args(&["start"]), Some("x".into())).is_err());
        assert!(parse_args(&args(&["start", "--verbose"]), None).is_err());
        assert_eq!(
            parse_args(&args(&["restart"]), None).unwrap(),
            (Action::Restart, 9092, None)
        );
        assert_eq!(
            parse_args(&args(&["resume", "--port", "19092"]), None).unwrap(),
            (Action::Resume, 19092, None)
        );
        assert_eq!(
            parse_args(&args(&["kill"]), None).unwrap(),
            (Action::Kill, 9092, None)
        );
        assert_eq!(
            parse_args(&args(&["discard", "--port", "19092"]), None).unwrap(),
            (Action::Discard, 19092, None)
        );
        assert!(parse_args(&args(&["reboot"]), None).is_err());
        assert!(parse_args(&args(&[]), None).is_err());
    }

    #[test]
    fn the_shipped_template_renders_completely() {
        let template = include_str!("../../tools/kafka/server.properties.in");
        let values = [
            ("PORT", "19092".to_owned()),
            ("CONTROLLER_PORT", "40001".to_owned()),
            ("SASL_SSL_PORT", "40002".to_owned()),
            ("DATA", "/tmp/kafka/data".to_owned()),
            ("KEYSTORE", "/tmp/kafka/broker.p12".to_owned()),
            ("KEYSTORE_PASSWORD", "pw".to_owned()),
            ("SASL_USER", "u".to_owned()),
            ("SASL_PASSWORD", "p".to_owned()),
        ];
        let rendered = render_properties(template, &values).unwrap();
        assert!(rendered.contains(
            "listeners=PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:40001,SASL_SSL://127.0.0.1:40002\n"
        ));
        assert!(rendered.contains(
            "advertised.listeners=PLAINTEXT://127.0.0.1:19092,SASL_SSL://127.0.0.1:40002\n"
        ));
        assert!(rendered.contains("controller.quorum.bootstrap.servers=127.0.0.1:40001\n"));
        assert!(rendered.contains("log.dirs=/tmp/kafka/data\n"));
        assert!(rendered.contains("ssl.keystore.location=/tmp/kafka/broker.p12\n"));
        assert!(rendered.contains("user_u=\"p\";"));
        assert!(render_properties("x=@OTHER@\n", &values).is_err());
    }

    #[test]
    fn oidc_settings_name_the_issuers_keys_and_let_the_broker_fetch_them() {
        let text = oidc_properties("http://127.0.0.1:8380/realms/tinyflow/");
        assert!(
            text.contains(
                "sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512,PLAIN,OAUTHBEARER\n"
            )
        );
        assert!(text.contains(
            "sasl.oauthbearer.jwks.endpoint.url=http://127.0.0.1:8380/realms/tinyflow/protocol/openid-connect/certs\n"
        ));
        assert!(
            text.contains(
                "sasl.oauthbearer.expected.issuer=http://127.0.0.1:8380/realms/tinyflow\n"
            )
        );
        assert_eq!(
            allowed_urls_option(&format!("a=b\n{text}")).as_deref(),
            Some(
                "-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls=http://127.0.0.1:8380/realms/tinyflow/protocol/openid-connect/certs"
            )
        );
        assert_eq!(allowed_urls_option("a=b\n"), None);
        for args in [
            vec!["start", "--oidc-issuer", "http://x"],
            vec!["start", "--oidc-issuer=http://x"],
        ] {
            let args: Vec<String> = args.into_iter().map(String::from).collect();
            assert_eq!(
                parse_args(&args, None).unwrap(),
                (Action::Start, 9092, Some("http://x".to_owned()))
            );
        }
        assert!(parse_args(&["start".into(), "--oidc-issuer".into()], None).is_err());
    }

    #[test]
    fn base64_matches_kafka_uuid_strings() {
        // Kafka's Uuid.ZERO_UUID and Uuid.METADATA_TOPIC_ID (new Uuid(0, 1)).
        assert_eq!(base64_url(&[0; 16]), "AAAAAAAAAAAAAAAAAAAAAA");
        let mut one = [0; 16];
        one[15] = 1;
        assert_eq!(base64_url(&one), "AAAAAAAAAAAAAAAAAAAAAQ");
        // RFC 4648 test vectors, unpadded.
        assert_eq!(base64_url(b"f"), "Zg");
        assert_eq!(base64_url(b"fo"), "Zm8");
        assert_eq!(base64_url(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn cluster_ids_have_the_form_kafka_expects() {
        let id = cluster_id(9092);
        assert_eq!(id.len(), 22);
        assert!(id.starts_with(|c: char| c.is_ascii_alphabetic()));
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
    }
}
