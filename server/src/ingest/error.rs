//! What registering a run or storing a batch can fail with: the request itself is
//! wrong (a body the run's registration refuses, a registration that differs from
//! the stored one), or the store failed under it. The routes answer each with the
//! error body of docs/PROTOCOL.md.

use gradflow_protocol::InvalidBody;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The body is well formed but the run refuses it (a parameter not registered
    /// at its step, a rank outside the run, an amendment that does not hold
    /// together): nothing of the batch is stored.
    #[error(transparent)]
    Invalid(InvalidBody),
    /// A registration sent again that differs from the stored one at `path`.
    #[error("{message}")]
    Conflict { path: String, message: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A failure of the server's own (encoding state, a zstd context) is the store's
/// internal error, as before ingest had an error type of its own.
impl From<anyhow::Error> for IngestError {
    fn from(error: anyhow::Error) -> Self {
        IngestError::Store(StoreError::Internal(error))
    }
}

impl IngestError {
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> IngestError {
        IngestError::Invalid(InvalidBody::new(path, message))
    }
}

pub type IngestResult<T> = Result<T, IngestError>;
