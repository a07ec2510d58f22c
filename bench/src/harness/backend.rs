//! Where a measured server keeps its data: a SQLite file in a fresh temporary
//! directory, or a fresh database on a PostgreSQL cluster the harness started
//! (`gradflow_e2e::postgres`, with fsync on), one per measurement either way.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use gradflow_e2e::ServerProcess;
use gradflow_e2e::postgres::{Postgres, postgres_required};
use sqlx::Connection;

use crate::server::bytes_on_disk;

/// The database a measurement's servers share.
#[derive(Clone)]
pub enum Backend {
    /// A SQLite file (`--db`) in a fresh temporary directory.
    Sqlite,
    /// A fresh database on this PostgreSQL server (`--database postgres://…`).
    Postgres(Arc<Postgres>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Sqlite => "SQLite",
            Backend::Postgres(_) => "PostgreSQL",
        }
    }
}

/// A throwaway PostgreSQL cluster with the server's durability at its defaults
/// (fsync on, `synchronous_commit` on), or `None`, said on stderr, when none can be
/// started here; an error instead when `GRADFLOW_REQUIRE_POSTGRES=1`.
pub async fn postgres() -> anyhow::Result<Option<Arc<Postgres>>> {
    match tokio::task::spawn_blocking(Postgres::start_durable).await? {
        Ok(postgres) => Ok(Some(Arc::new(postgres))),
        Err(error) if !postgres_required() => {
            eprintln!(
                "gradflow-bench: PostgreSQL cannot be started ({error:#}): its measurements are skipped"
            );
            Ok(None)
        }
        Err(error) => Err(error
            .context("PostgreSQL is required (GRADFLOW_REQUIRE_POSTGRES=1) but cannot be started")),
    }
}

/// One measurement's fresh, empty database.
pub enum Database {
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
    Postgres {
        url: String,
    },
}

impl Database {
    pub async fn fresh(backend: &Backend) -> anyhow::Result<Database> {
        Ok(match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().context("a temporary directory")?;
                let path = dir.path().join("bench.db");
                Database::Sqlite { _dir: dir, path }
            }
            Backend::Postgres(postgres) => Database::Postgres {
                url: postgres.create_database().await,
            },
        })
    }

    /// A `gradflow-server` on this database, ready for requests (a server on
    /// PostgreSQL listens before it has reached the database: `/readyz` says when).
    pub async fn start(&self, args: &[String]) -> anyhow::Result<ServerProcess> {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match self {
            Database::Sqlite { path, .. } => Ok(ServerProcess::start(path, &args)),
            Database::Postgres { url } => {
                let server = ServerProcess::start_on_database(url, "127.0.0.1:0", &args);
                wait_ready(&server, Duration::from_secs(60)).await?;
                Ok(server)
            }
        }
    }

    /// What the data takes once the servers have stopped. SQLite: the database file
    /// and its WAL. PostgreSQL: `pg_total_relation_size` of every ordinary table in
    /// schema `public`, so each table's heap, free-space and visibility maps, its
    /// TOAST table and TOAST index, and every index on it; not the cluster's WAL nor
    /// the catalogs, and measured without a `VACUUM` or `CHECKPOINT` first.
    pub async fn bytes(&self) -> anyhow::Result<u64> {
        match self {
            Database::Sqlite { path, .. } => Ok(bytes_on_disk(path)),
            Database::Postgres { url } => {
                let mut conn = sqlx::PgConnection::connect(url)
                    .await
                    .with_context(|| format!("connecting to {}", url))?;
                let bytes: i64 = sqlx::query_scalar(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint \
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE n.nspname = 'public' AND c.relkind = 'r'",
                )
                .fetch_one(&mut conn)
                .await
                .context("the tables' sizes")?;
                conn.close().await.ok();
                Ok(bytes.max(0) as u64)
            }
        }
    }

    /// Drops a PostgreSQL database (its servers stopped), so that the cluster's disk
    /// holds one measurement at a time; a SQLite directory goes when dropped.
    pub async fn remove(self) -> anyhow::Result<()> {
        if let Database::Postgres { url } = self {
            let (base, name) = url
                .rsplit_once('/')
                .with_context(|| format!("no database in {}", url))?;
            let mut conn = sqlx::PgConnection::connect(&format!("{base}/postgres"))
                .await
                .context("connecting to the cluster's postgres database")?;
            sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                .execute(&mut conn)
                .await
                .with_context(|| format!("dropping database {name}"))?;
            conn.close().await.ok();
        }
        Ok(())
    }
}

/// Waits until the server's `/readyz` answers 200.
async fn wait_ready(server: &ServerProcess, limit: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    loop {
        let ready = client
            .get(server.url("/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ready {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "{} not ready within {limit:?}:\n{}",
            server.base,
            server.logs().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
