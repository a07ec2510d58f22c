//! SQLite, the embedded default: one file, one writer connection, a pool of readers
//! that WAL mode lets run beside it.
//!
//! The writer is a pool of exactly one connection, so a batch holds it from `BEGIN`
//! to `COMMIT` and others wait their turn (SQLite allows one writer anyway). A
//! transaction that failed on an I/O error (full disk, read-only file) can leave
//! sqlx's transaction bookkeeping out of step with SQLite: SQLite has rolled back,
//! or still holds a transaction its failed `ROLLBACK` could not end, while sqlx
//! counts one open. Its next `begin` would then be a `SAVEPOINT` inside it and its
//! "commit" a `RELEASE` that commits nothing: batches acknowledged and lost. So a
//! writer that comes back to the pool still counting a transaction is closed (which
//! rolls back whatever it held), and the pool opens a fresh one.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, SqliteConnection};

use super::SyncMode;

/// Readers open at once.
const READERS: u32 = 4;
/// How long a batch waits for the writer before the request is answered `503`.
const WRITER_WAIT: Duration = Duration::from_secs(60);

pub(crate) struct SqliteDb {
    pub read: SqlitePool,
    pub write: SqlitePool,
}

impl SqliteDb {
    /// Opens (creating if missing) the database at `path` and applies the migrations.
    pub async fn open(path: &Path, sync: SyncMode) -> anyhow::Result<SqliteDb> {
        let url = format!("sqlite://{}", path.display());
        let options = SqliteConnectOptions::from_str(&url)
            .with_context(|| format!("parsing database path {}", path.display()))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match sync {
                SyncMode::Full => SqliteSynchronous::Full,
                SyncMode::Normal => SqliteSynchronous::Normal,
            })
            // Takes effect only when the file is created; retention frees pages with
            // incremental vacuum instead of rewriting the whole file.
            .auto_vacuum(SqliteAutoVacuum::Incremental)
            .page_size(16384)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5))
            .pragma("cache_size", "-65536"); // 64 MiB per connection
        let mut conn = SqliteConnection::connect_with(&options)
            .await
            .with_context(|| format!("opening database {}", path.display()))?;
        sqlx::migrate!("../migrations/sqlite")
            .run(&mut conn)
            .await
            .with_context(|| format!("applying migrations to {}", path.display()))?;
        conn.close().await.ok();
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(WRITER_WAIT)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .after_release(|conn, _| {
                Box::pin(async move {
                    // The ping runs after any rollback the dropped transaction queued,
                    // so the count below is the settled one.
                    conn.ping().await?;
                    if conn.is_in_transaction() {
                        tracing::warn!(
                            "replacing the database writer connection after a failed transaction"
                        );
                        return Ok(false);
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await
            .with_context(|| format!("opening the writer of {}", path.display()))?;
        // Readers set nothing that writes: setting journal_mode or auto_vacuum on a
        // new connection needs the write lock, so a reader opened while the database
        // is locked, read-only or on a full disk would fail, and reads must go on
        // while writes cannot.
        let read_options = SqliteConnectOptions::from_str(&url)
            .with_context(|| format!("parsing database path {}", path.display()))?
            .read_only(true)
            .busy_timeout(Duration::from_secs(5))
            .pragma("cache_size", "-65536");
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(read_options)
            .await
            .with_context(|| format!("opening read connections to {}", path.display()))?;
        Ok(SqliteDb { read, write })
    }

    /// Waits for the batch in flight, checkpoints the WAL into the main file and
    /// closes every connection.
    pub async fn close(&self) -> anyhow::Result<()> {
        let mut writer = self
            .write
            .acquire()
            .await
            .context("waiting for the writer")?;
        self.read.close().await;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut *writer)
            .await
            .context("checkpointing the WAL")?;
        drop(writer);
        self.write.close().await;
        Ok(())
    }

    /// Returns free pages to the file system: the database is created with
    /// `auto_vacuum = INCREMENTAL`, so `incremental_vacuum` moves pages down and
    /// truncates, and a checkpoint carries the smaller file out of the WAL. Best
    /// effort: the pages stay reusable if it cannot run now (a reader holds the WAL).
    pub async fn free_space(&self) {
        let mut writer = match self.write.acquire().await {
            Ok(writer) => writer,
            Err(error) => {
                tracing::warn!(%error, "could not free the space of deleted runs yet");
                return;
            }
        };
        for pragma in [
            "PRAGMA incremental_vacuum",
            "PRAGMA wal_checkpoint(TRUNCATE)",
        ] {
            if let Err(error) = sqlx::query(pragma).execute(&mut *writer).await {
                tracing::warn!(%error, pragma, "could not free the space of deleted runs yet");
            }
        }
    }
}

/// Whether a SQLite result code is a condition that passes: BUSY, LOCKED, READONLY,
/// IOERR, FULL, CANTOPEN (primary codes; extended codes carry them in the low byte).
pub(crate) fn is_transient_code(code: Option<&str>) -> bool {
    const TRANSIENT: [i64; 6] = [5, 6, 8, 10, 13, 14];
    code.and_then(|c| c.parse::<i64>().ok())
        .is_some_and(|code| TRANSIENT.contains(&(code & 0xff)))
}
