//! The runtime's error type.

use tinyflow_api::StreamError;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a job failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Restarts were used up (or not allowed); `cause` is the last attempt's
    /// root cause.
    #[error("job failed after {attempts} attempt(s)")]
    JobFailed {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        cause: Box<Error>,
    },
    /// A task's user code or connector failed.
    #[error("task {task} failed")]
    Task {
        /// `node[subtask]`.
        task: String,
        /// The error.
        #[source]
        source: StreamError,
    },
    /// A task panicked.
    #[error("task {task} panicked: {message}")]
    Panic {
        /// `node[subtask]`.
        task: String,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// The checkpoint coordinator failed the attempt (or could not start).
    #[error("checkpoint coordinator")]
    Checkpoint(#[from] tinyflow_checkpoint::Error),
    /// Building or restoring the job failed.
    #[error("setting up the job")]
    Setup(#[from] StreamError),
}

impl Error {
    /// Whether restarting from the last checkpoint may help.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::JobFailed { .. } => false,
            Error::Task { source, .. } | Error::Setup(source) => source.is_retryable(),
            Error::Panic { .. } => true,
            Error::Checkpoint(e) => e.is_retryable(),
        }
    }
}
