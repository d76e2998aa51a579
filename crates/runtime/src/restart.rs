//! Restart strategies: how often and how soon a failed job attempt is
//! restarted from the newest completed checkpoint.

use std::time::Duration;

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum RestartStrategy {
    /// Never restart: the first failure fails the job.
    None,
    /// Restart after a fixed delay, at most `max_attempts` times.
    FixedDelay {
        /// Pause before each restart.
        delay: Duration,
        /// Restarts allowed.
        max_attempts: u32,
    },
    /// Restart after a delay that grows by `multiplier` from `initial` up to
    /// `max`, at most `max_attempts` times.
    ExponentialBackoff {
        /// Pause before the first restart.
        initial: Duration,
        /// Upper bound of the pause.
        max: Duration,
        /// Growth factor (at least 1).
        multiplier: f64,
        /// Restarts allowed.
        max_attempts: u32,
    },
}

impl Default for RestartStrategy {
    fn default() -> Self {
        RestartStrategy::ExponentialBackoff {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(60),
            multiplier: 2.0,
            max_attempts: 10,
        }
    }
}

impl RestartStrategy {
    /// The pause before restart number `restart` (1 for the first), or
    /// `None` when restarts are used up.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tinyflow_runtime::RestartStrategy;
    /// let s = RestartStrategy::ExponentialBackoff {
    ///     initial: Duration::from_millis(100),
    ///     max: Duration::from_millis(350),
    ///     multiplier: 2.0,
    ///     max_attempts: 4,
    /// };
    /// let delays: Vec<_> = (1..=5).map(|n| s.delay_before(n)).collect();
    /// assert_eq!(delays, [100, 200, 350, 350].map(|ms| Some(Duration::from_millis(ms))).into_iter().chain([None]).collect::<Vec<_>>());
    /// ```
    pub fn delay_before(&self, restart: u32) -> Option<Duration> {
        match *self {
            RestartStrategy::None => None,
            RestartStrategy::FixedDelay {
                delay,
                max_attempts,
            } => (restart <= max_attempts).then_some(delay),
            RestartStrategy::ExponentialBackoff {
                initial,
                max,
                multiplier,
                max_attempts,
            } => {
                if restart > max_attempts {
                    return None;
                }
                let factor = multiplier
                    .max(1.0)
                    .powi(i32::try_from(restart - 1).unwrap_or(i32::MAX));
                let delay = initial.as_secs_f64() * factor;
                Some(Duration::from_secs_f64(delay.min(max.as_secs_f64())))
            }
        }
    }
}
