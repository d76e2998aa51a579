//! Durations in job files: `250ms`, `1s`, `1.5s`, `2m`, `1h`.

use std::time::Duration;

/// Parses `<number><unit>` with unit `ms`, `s`, `m` or `h`.
///
/// ```
/// use std::time::Duration;
/// use tinyflow_cli::parse_duration;
/// assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
/// assert!(parse_duration("5").is_err());
/// ```
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("`{s}` has no unit; expected e.g. 500ms, 1s, 2m or 1h"))?;
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{s}`: `{number}` is not a number"))?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "`{s}`: unknown unit `{other}`; expected ms, s, m or h"
            ));
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || secs > 1e9 {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The inverse of [`parse_duration`] for whole milliseconds.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}
