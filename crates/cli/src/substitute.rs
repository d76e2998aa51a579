//! `${NAME}`, `${NAME:-default}` and `${file:PATH}` in a job file's string
//! values (see [`JobFile::parse_with`](crate::JobFile::parse_with)).

use crate::JobFileError;

/// Replaces the references in every string of `value`; `key` is the path
/// so far, for errors. Values substituted under keys that look secret are
/// registered with [`tinyflow_api::secrets`].
pub(crate) fn substitute(
    value: &mut toml::Value,
    key: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), JobFileError> {
    match value {
        toml::Value::String(s) if s.contains('$') => {
            let (out, substituted) = expand(s, env).map_err(|m| JobFileError::new(key, m))?;
            if substituted && tinyflow_api::secrets::is_secret_key(key) {
                tinyflow_api::secrets::register(&out);
            }
            *s = out;
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                substitute(item, &format!("{key}[{i}]"), env)?;
            }
        }
        toml::Value::Table(table) => {
            for (k, v) in table.iter_mut() {
                let path = if key.is_empty() {
                    k.clone()
                } else {
                    format!("{key}.{k}")
                };
                substitute(v, &path, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// `text` with its references replaced, and whether there were any.
fn expand(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<(String, bool), String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut any = false;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        if let Some(r) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = r;
            continue;
        }
        let Some(body) = after.strip_prefix("${") else {
            out.push('$');
            rest = &after[1..];
            continue;
        };
        let end = body
            .find('}')
            .ok_or_else(|| format!("`{after}`: a `${{` without its `}}`"))?;
        let reference = &body[..end];
        out.push_str(&resolve(reference, env)?);
        any = true;
        rest = &body[end + 1..];
    }
    out.push_str(rest);
    Ok((out, any))
}

fn resolve(reference: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    if let Some(path) = reference.strip_prefix("file:") {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("`${{file:{path}}}`: cannot read the file: {e}"))?;
        return Ok(text
            .strip_suffix('\n')
            .map(|t| t.strip_suffix('\r').unwrap_or(t))
            .unwrap_or(&text)
            .to_owned());
    }
    let (name, default) = match reference.split_once(":-") {
        Some((name, default)) => (name, Some(default)),
        None => (reference, None),
    };
    let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(format!(
            "`${{{reference}}}`: expected ${{NAME}}, ${{NAME:-default}} or ${{file:PATH}}"
        ));
    }
    match (env(name).filter(|v| !v.is_empty()), default) {
        (Some(v), _) => Ok(v),
        (None, Some(d)) => Ok(d.to_owned()),
        (None, None) => Err(format!(
            "`${{{name}}}` is not set in the environment (give a default with ${{{name}:-...}})"
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "USER_NAME" => Some("alice".to_owned()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn references_expand_and_errors_say_which() {
        let e = |t: &str| expand(t, &env);
        assert_eq!(e("plain").unwrap(), ("plain".to_owned(), false));
        assert_eq!(e("${USER_NAME}").unwrap().0, "alice");
        assert_eq!(e("a-${USER_NAME}-b").unwrap().0, "a-alice-b");
        assert_eq!(e("${NOPE:-dflt}").unwrap().0, "dflt");
        assert_eq!(e("${EMPTY:-dflt}").unwrap().0, "dflt");
        assert_eq!(e("${USER_NAME:-dflt}").unwrap().0, "alice");
        assert_eq!(e("cost $5").unwrap().0, "cost $5");
        assert_eq!(
            e("$${USER_NAME}").unwrap(),
            ("${USER_NAME}".to_owned(), false)
        );
        assert!(e("${NOPE}").unwrap_err().contains("`${NOPE}` is not set"));
        assert!(e("${USER_NAME").unwrap_err().contains("without its"));
        assert!(e("${a b}").unwrap_err().contains("expected"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "s3cr3t\n").unwrap();
        assert_eq!(
            e(&format!("${{file:{}}}", path.display())).unwrap().0,
            "s3cr3t"
        );
        assert!(
            e("${file:/nonexistent/secret}")
                .unwrap_err()
                .contains("cannot read the file")
        );
    }
}
