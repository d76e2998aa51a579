//! A client of a Confluent-compatible schema registry (Confluent Schema
//! Registry, Redpanda's, Karapace, Apicurio's `ccompat` API, Aiven's,
//! Confluent Cloud's): writer schemas fetched by id, the latest version of a
//! subject, over HTTP or HTTPS with optional basic authentication.
//!
//! Errors say whether waiting can mend them ([`RegistryError::is_transient`]):
//! an unreachable or failing registry can; an unknown id or refused
//! credentials cannot.

use std::path::PathBuf;
use std::time::Duration;

/// Where the registry is and how to reach it.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryConfig {
    /// Its base URL, `http://host:8081` or `https://...` (a path prefix is
    /// kept: `https://host/api/ccompat/v7`).
    pub url: String,
    /// HTTP basic authentication (Confluent Cloud's API key and secret).
    pub username: Option<String>,
    pub password: Option<String>,
    /// A PEM file of the CA certificates that sign an `https` registry's
    /// certificate, added to the system's roots.
    pub ca_location: Option<PathBuf>,
    /// How long one request may take.
    pub timeout: Duration,
}

impl std::fmt::Debug for RegistryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryConfig")
            .field("url", &self.url)
            .field("username", &self.username)
            .field(
                "password",
                &self.password.as_ref().map(|_| tinyflow_api::secrets::MASK),
            )
            .field("ca_location", &self.ca_location)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RegistryConfig {
    /// A registry at `url`, without authentication, with a 10 s timeout.
    pub fn new(url: impl Into<String>) -> Self {
        RegistryConfig {
            url: url.into(),
            username: None,
            password: None,
            ca_location: None,
            timeout: Duration::from_secs(10),
        }
    }

    /// With HTTP basic authentication.
    pub fn basic_auth(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        let password = password.into();
        tinyflow_api::secrets::register(&password);
        self.username = Some(username.into());
        self.password = Some(password);
        self
    }

    /// Trusting the CA certificates in this PEM file too.
    pub fn ca_location(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_location = Some(path.into());
        self
    }
}

/// What the registry holds under one id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredSchema {
    pub id: u32,
    /// `AVRO`, `PROTOBUF` or `JSON` (the registry omits it for Avro).
    pub schema_type: String,
    /// The schema's text: Avro's JSON, a `.proto` file, a JSON Schema.
    pub schema: String,
    /// Whether it refers to other schemas (not followed yet).
    pub has_references: bool,
}

/// Why the registry did not answer with a schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// It does not know the id or subject (HTTP 404).
    #[error("the schema registry at {url} has no {what}: {message}")]
    NotFound {
        url: String,
        what: String,
        message: String,
    },
    /// It refused the credentials or the request (HTTP 401, 403, other
    /// 4xx): waiting does not mend this.
    #[error("the schema registry at {url} refused {what} (HTTP {status}): {message}")]
    Refused {
        url: String,
        what: String,
        status: u16,
        message: String,
    },
    /// It could not be reached, timed out or failed (5xx): may pass.
    #[error("the schema registry at {url} did not answer {what}: {message}")]
    Unreachable {
        url: String,
        what: String,
        message: String,
    },
    /// Its certificate is not trusted (or TLS failed in a way retrying does
    /// not mend).
    #[error(
        "the schema registry at {url}: its certificate is not trusted: check source.registry.ca_location ({message})"
    )]
    Untrusted { url: String, message: String },
    /// The settings are wrong (a CA file that cannot be read, ...).
    #[error("schema registry settings: {0}")]
    Config(String),
}

impl RegistryError {
    /// Whether trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, RegistryError::Unreachable { .. })
    }
}

/// A registry client; cheap to clone (one connection pool).
#[derive(Debug, Clone)]
pub struct Registry {
    config: RegistryConfig,
    base: String,
    client: reqwest::Client,
}

impl Registry {
    /// A client for `config`; fails only on settings (an unreadable CA file).
    pub fn new(config: RegistryConfig) -> Result<Self, RegistryError> {
        let mut builder = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(5)));
        if let Some(path) = &config.ca_location {
            let pem = std::fs::read(path).map_err(|e| {
                RegistryError::Config(format!("cannot read the CA file {}: {e}", path.display()))
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                RegistryError::Config(format!(
                    "the CA file {} holds no PEM certificate: {e}",
                    path.display()
                ))
            })?;
            builder = builder.tls_certs_merge(certs);
        }
        let client = builder
            .build()
            .map_err(|e| RegistryError::Config(format!("cannot build an HTTP client: {e}")))?;
        let base = config.url.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(RegistryError::Config(format!(
                "the registry URL {:?} must start with http:// or https://",
                config.url
            )));
        }
        Ok(Registry {
            config,
            base,
            client,
        })
    }

    /// The registry's URL, for messages.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// The schema registered under `id`.
    pub async fn schema_by_id(&self, id: u32) -> Result<RegisteredSchema, RegistryError> {
        let body = self
            .get(&format!("schemas/ids/{id}"), &format!("schema id {id}"))
            .await?;
        parse_schema(id, &body).map_err(|message| RegistryError::Unreachable {
            url: self.base.clone(),
            what: format!("schema id {id}"),
            message,
        })
    }

    /// The latest version of `subject`.
    pub async fn latest(&self, subject: &str) -> Result<RegisteredSchema, RegistryError> {
        let what = format!("subject {subject:?}");
        let body = self
            .get(
                &format!("subjects/{}/versions/latest", encode(subject)),
                &what,
            )
            .await?;
        let id = body
            .get("id")
            .and_then(serde_json::Value::as_u64)
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| RegistryError::Unreachable {
                url: self.base.clone(),
                what: what.clone(),
                message: format!("an answer without a schema id: {body}"),
            })?;
        parse_schema(id, &body).map_err(|message| RegistryError::Unreachable {
            url: self.base.clone(),
            what,
            message,
        })
    }

    async fn get(&self, path: &str, what: &str) -> Result<serde_json::Value, RegistryError> {
        let url = format!("{}/{path}", self.base);
        let mut request = self.client.get(&url).header(
            "Accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some(user) = &self.config.username {
            request = request.basic_auth(user, self.config.password.as_deref());
        }
        let unreachable = |message: String| RegistryError::Unreachable {
            url: self.base.clone(),
            what: what.to_owned(),
            message: tinyflow_api::secrets::scrub(&message),
        };
        let response = request.send().await.map_err(|e| {
            let message = chain(&e);
            if message.contains("certificate") || message.contains("UnknownIssuer") {
                RegistryError::Untrusted {
                    url: self.base.clone(),
                    message,
                }
            } else {
                unreachable(message)
            }
        })?;
        let status = response.status();
        let text = response.text().await.map_err(|e| unreachable(chain(&e)))?;
        if status.is_success() {
            return serde_json::from_str(&text).map_err(|e| {
                unreachable(format!("an answer that is not JSON ({e}): {text:.200}"))
            });
        }
        // Confluent's error body: {"error_code": 40403, "message": "..."}.
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("message")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("{text:.200}"));
        Err(match status.as_u16() {
            404 => RegistryError::NotFound {
                url: self.base.clone(),
                what: what.to_owned(),
                message,
            },
            s @ (408 | 429) | s @ 500.. => unreachable(format!("HTTP {s}: {message}")),
            s => RegistryError::Refused {
                url: self.base.clone(),
                what: what.to_owned(),
                status: s,
                message,
            },
        })
    }
}

/// The error and its causes, `a: b: c` (reqwest's own message is only the
/// outermost, "error sending request").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// Percent-encodes a path segment (subjects may hold `.`, `:`, spaces...).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn parse_schema(id: u32, body: &serde_json::Value) -> Result<RegisteredSchema, String> {
    let schema = body
        .get("schema")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("an answer without a schema: {body:.200}"))?;
    Ok(RegisteredSchema {
        id,
        schema_type: body
            .get("schemaType")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("AVRO")
            .to_owned(),
        schema: schema.to_owned(),
        has_references: body
            .get("references")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|r| !r.is_empty()),
    })
}

/// How the subject of a topic's values is named, as Confluent's
/// serializers' `subject.name.strategy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectStrategy {
    /// `<topic>-value` (Confluent's default).
    Topic,
    /// `<record full name>`.
    Record(String),
    /// `<topic>-<record full name>`.
    TopicRecord(String),
}

impl SubjectStrategy {
    /// The subject of `topic`'s values.
    pub fn subject(&self, topic: &str) -> String {
        match self {
            SubjectStrategy::Topic => format!("{topic}-value"),
            SubjectStrategy::Record(r) => r.clone(),
            SubjectStrategy::TopicRecord(r) => format!("{topic}-{r}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_named_as_confluents_strategies_name_them() {
        assert_eq!(SubjectStrategy::Topic.subject("bids"), "bids-value");
        let r = "nexmark.Bid".to_owned();
        assert_eq!(
            SubjectStrategy::Record(r.clone()).subject("bids"),
            "nexmark.Bid"
        );
        assert_eq!(
            SubjectStrategy::TopicRecord(r).subject("bids"),
            "bids-nexmark.Bid"
        );
        assert_eq!(encode("a b/c:d.e"), "a%20b%2Fc%3Ad.e");
    }

    #[test]
    fn a_url_without_a_scheme_and_an_unreadable_ca_are_settings_errors() {
        let e = Registry::new(RegistryConfig::new("localhost:8081")).unwrap_err();
        assert!(e.to_string().contains("must start with http"), "{e}");
        let e = Registry::new(RegistryConfig::new("http://x").ca_location("/nonexistent.pem"))
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent.pem"), "{e}");
        assert!(!e.is_transient());
    }

    #[test]
    fn the_password_is_not_in_debug_output() {
        let c = RegistryConfig::new("http://x").basic_auth("key", "registry-secret-1");
        assert!(!format!("{c:?}").contains("registry-secret-1"));
    }

    #[tokio::test]
    async fn an_unreachable_registry_is_transient_and_named() {
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let url = format!("http://127.0.0.1:{port}");
        let r = Registry::new(RegistryConfig::new(&url)).expect("valid settings");
        let e = r.schema_by_id(7).await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&url) && text.contains("schema id 7"),
            "{text}"
        );
    }
}
