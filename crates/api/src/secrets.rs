//! Secrets kept out of every output: one rule for which settings hold a
//! secret ([`is_secret_key`]), and a process-wide set of secret values
//! ([`register`]) that [`scrub`] replaces with `***` in any text, including
//! text a client library echoes back (librdkafka quoting a property, a
//! catalog client quoting a URI). Connectors register the secret values of
//! the settings they pass through; the `tinyflow` command scrubs everything
//! it writes (logs, errors, command output) with it.

use std::sync::RwLock;

/// What replaces a secret.
pub const MASK: &str = "***";

/// Values shorter than this are not registered: scrubbing every `a` or
/// `on` out of the logs would hide more than it protects.
const MIN_LEN: usize = 4;

static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Whether a setting named `key` holds a secret: its name contains
/// `password`, `secret`, `token`, `key`, `credential` or `jaas`, or it is
/// `sasl.oauthbearer.config` (which holds an OIDC client secret). Case does
/// not matter; `key` may be a dotted path (`source.properties.sasl.password`).
///
/// ```
/// use tinyflow_api::secrets::is_secret_key;
/// assert!(is_secret_key("sasl.password"));
/// assert!(is_secret_key("ssl.key.password"));
/// assert!(is_secret_key("s3.secret-access-key"));
/// assert!(is_secret_key("sasl.jaas.config"));
/// assert!(is_secret_key("sasl.oauthbearer.config"));
/// assert!(is_secret_key("token"));
/// assert!(!is_secret_key("bootstrap.servers"));
/// assert!(!is_secret_key("sasl.username"));
/// ```
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.ends_with("sasl.oauthbearer.config")
        || ["password", "secret", "token", "key", "credential", "jaas"]
            .iter()
            .any(|s| k.contains(s))
}

/// Remembers `value` as a secret for [`scrub`] (values shorter than four
/// characters are ignored).
pub fn register(value: &str) {
    if value.len() < MIN_LEN {
        return;
    }
    let mut secrets = SECRETS.write().unwrap_or_else(|p| p.into_inner());
    if !secrets.iter().any(|s| s == value) {
        secrets.push(value.to_owned());
        // Longest first, so that a secret containing another is masked whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }
}

/// Registers the value of every setting in `settings` whose key is secret
/// ([`is_secret_key`]), and the password of every URI-looking value
/// (`scheme://user:password@host`).
pub fn register_settings<'a>(settings: impl IntoIterator<Item = (&'a str, &'a str)>) {
    for (k, v) in settings {
        if is_secret_key(k) {
            register(v);
        }
        if let Some(password) = uri_password(v) {
            register(password);
        }
    }
}

/// The password in `scheme://user:password@host...`, if any.
pub fn uri_password(uri: &str) -> Option<&str> {
    let (_, rest) = uri.split_once("://")?;
    let (auth, _) = rest.split_once('@')?;
    let (_, password) = auth.split_once(':')?;
    (!password.is_empty()).then_some(password)
}

/// `text` with every registered secret replaced by [`MASK`].
///
/// ```
/// tinyflow_api::secrets::register("hunter2-example");
/// assert_eq!(
///     tinyflow_api::secrets::scrub("login with hunter2-example failed"),
///     "login with *** failed"
/// );
/// ```
pub fn scrub(text: &str) -> String {
    let secrets = SECRETS.read().unwrap_or_else(|p| p.into_inner());
    let mut out = text.to_owned();
    for s in secrets.iter() {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), MASK);
        }
    }
    out
}

/// `value`, or [`MASK`] when `key` holds a secret: for `Debug` output of
/// settings.
pub fn shown<'a>(key: &str, value: &'a str) -> &'a str {
    if is_secret_key(key) { MASK } else { value }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_passwords_and_short_values() {
        assert_eq!(uri_password("postgres://u:pw-1234@h/db"), Some("pw-1234"));
        assert_eq!(uri_password("postgres://u@h/db"), None);
        assert_eq!(uri_password("http://h:8181"), None);
        register("abc");
        assert_eq!(scrub("abc"), "abc", "too short to be registered");
        register_settings([
            ("sasl.password", "a-long-secret"),
            ("url", "s3://k:s3-pass-99@h"),
        ]);
        assert_eq!(scrub("x a-long-secret y s3-pass-99"), "x *** y ***");
        register("a-long-secret-with-more");
        assert_eq!(scrub("a-long-secret-with-more"), "***");
    }
}
