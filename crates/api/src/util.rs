//! Small helpers every crate uses: who this process is, calendar dates.

/// This process, as tools and other runs should see it: `pid N on HOST`.
/// For lock holders and sink epochs, so that an operator can find a run
/// that holds a job.
pub fn this_process() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".to_owned());
    format!("pid {} on {host}", std::process::id())
}

/// The proleptic Gregorian date (year, month 1-12, day 1-31) of `days`
/// since 1970-01-01 (Howard Hinnant's `civil_from_days`), for formatting
/// times without a date library.
///
/// ```
/// assert_eq!(tinyflow_api::util::civil_date(0), (1970, 1, 1));
/// assert_eq!(tinyflow_api::util::civil_date(19_700), (2023, 12, 9));
/// assert_eq!(tinyflow_api::util::civil_date(-1), (1969, 12, 31));
/// ```
pub fn civil_date(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}
