//! A throwaway PostgreSQL for the tests and benchmarks: Debian's `postgresql`
//! binaries (`initdb`, `pg_ctl`) running a cluster in a temporary directory on a free
//! loopback port, or the server `GRADFLOW_TEST_POSTGRES_URL` names.
//!
//! Every test gets a database of its own ([`Postgres::create_database`]). A test
//! that stops or restarts the database starts a cluster of its own
//! ([`Postgres::start`]). `initdb` and the server refuse to run as root, so as root
//! the cluster runs as the `postgres` user the package creates.
//!
//! - `GRADFLOW_TEST_BACKEND=postgres`: the server tests run against PostgreSQL
//!   instead of SQLite ([`test_backend`]).
//! - `GRADFLOW_TEST_POSTGRES_URL=postgres://user@host:port`: use this server (the
//!   user must be allowed to create databases) instead of starting one.
//! - `GRADFLOW_REQUIRE_POSTGRES=1`: a PostgreSQL that cannot be had is a failure, not
//!   a skip (CI sets it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sqlx::Connection;

/// The superuser the throwaway clusters are created with.
const SUPERUSER: &str = "gradflow";

/// A PostgreSQL server the tests may create databases on.
pub struct Postgres {
    /// `postgres://user@host:port` (no database).
    base: String,
    cluster: Option<Cluster>,
}

/// A cluster this process started (and stops when dropped).
struct Cluster {
    dir: tempfile::TempDir,
    data: PathBuf,
    port: u16,
    bin: PathBuf,
    /// Run the binaries as the `postgres` user (this process is root).
    as_postgres: bool,
}

/// Which database the server tests run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// `GRADFLOW_TEST_BACKEND`: `postgres`, or SQLite (the default).
pub fn test_backend() -> Backend {
    match std::env::var("GRADFLOW_TEST_BACKEND").as_deref() {
        Ok("postgres") | Ok("postgresql") => Backend::Postgres,
        _ => Backend::Sqlite,
    }
}

/// Whether a missing PostgreSQL must fail the test rather than skip it.
pub fn postgres_required() -> bool {
    std::env::var("GRADFLOW_REQUIRE_POSTGRES").is_ok_and(|v| v == "1")
}

impl Postgres {
    /// The server the tests of this process share: the one
    /// `GRADFLOW_TEST_POSTGRES_URL` names, or a throwaway cluster, started on first
    /// use and stopped when the last test holding it lets go. `None` when there is
    /// no PostgreSQL to be had (and it is not required).
    pub fn shared() -> Option<Arc<Postgres>> {
        static SHARED: Mutex<Weak<Postgres>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(postgres) = shared.upgrade() {
            return Some(postgres);
        }
        let postgres = match std::env::var("GRADFLOW_TEST_POSTGRES_URL") {
            Ok(url) => Postgres {
                base: url.trim_end_matches('/').to_owned(),
                cluster: None,
            },
            Err(_) => match Postgres::start() {
                Ok(postgres) => postgres,
                Err(error) if !postgres_required() => {
                    eprintln!("no PostgreSQL for this test ({error:#}); skipped");
                    return None;
                }
                Err(error) => panic!(
                    "PostgreSQL is required (GRADFLOW_REQUIRE_POSTGRES=1) but cannot be \
                     started: {error:#}"
                ),
            },
        };
        let postgres = Arc::new(postgres);
        *shared = Arc::downgrade(&postgres);
        Some(postgres)
    }

    /// Starts a throwaway cluster of its own: `initdb` in a temporary directory,
    /// then `pg_ctl start` on a free loopback port. Tuned for tests (no fsync):
    /// crash-safety of the database itself is PostgreSQL's, not what is tested.
    pub fn start() -> anyhow::Result<Postgres> {
        Self::start_with(&["-c", "fsync=off", "-c", "full_page_writes=off"])
    }

    /// [`Postgres::start`] with the server's durability left at its defaults, for
    /// tests that kill the database itself.
    pub fn start_durable() -> anyhow::Result<Postgres> {
        Self::start_with(&[])
    }

    fn start_with(settings: &[&str]) -> anyhow::Result<Postgres> {
        let bin = postgres_bin()?;
        let as_postgres = is_root();
        let dir = tempfile::Builder::new().prefix("gradflow-pg").tempdir()?;
        let data = dir.path().join("data");
        if as_postgres {
            chown_to_postgres(dir.path())?;
        }
        run(
            &bin,
            as_postgres,
            "initdb",
            &[
                "-D",
                path_str(&data),
                "-U",
                SUPERUSER,
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
        )?;
        let cluster = Cluster {
            port: free_port()?,
            dir,
            data,
            bin,
            as_postgres,
        };
        cluster.start(settings)?;
        Ok(Postgres {
            base: format!("postgres://{SUPERUSER}@127.0.0.1:{}", cluster.port),
            cluster: Some(cluster),
        })
    }

    /// A new, empty database; its URL.
    pub async fn create_database(&self) -> String {
        let name = format!("gf_{}_{}", std::process::id(), rand_suffix());
        let admin = format!("{}/postgres", self.base);
        let mut conn = connect_with_retry(&admin).await;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
        conn.close().await.ok();
        format!("{}/{name}", self.base)
    }

    /// The port of a cluster this process started.
    pub fn port(&self) -> Option<u16> {
        self.cluster.as_ref().map(|c| c.port)
    }

    /// Stops a cluster this process started (`pg_ctl stop -m fast`: clients are
    /// disconnected, what committed is kept).
    pub fn stop(&self) -> anyhow::Result<()> {
        self.cluster()?.stop("fast")
    }

    /// Starts a stopped cluster again, on the same port and data.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.cluster()?.start(&[])
    }

    fn cluster(&self) -> anyhow::Result<&Cluster> {
        self.cluster
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("this PostgreSQL was not started by the tests"))
    }
}

impl Cluster {
    fn start(&self, settings: &[&str]) -> anyhow::Result<()> {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200",
            self.port,
            path_str(self.dir.path())
        );
        for pair in settings.chunks(2) {
            options.push_str(&format!(" {} {}", pair[0], pair[1]));
        }
        let log = self.dir.path().join("postgres.log");
        run(
            &self.bin,
            self.as_postgres,
            "pg_ctl",
            &[
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                path_str(&self.data),
                "-l",
                path_str(&log),
                "-o",
                &options,
            ],
        )
        .map_err(|e| {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            anyhow::anyhow!("{e}\n--- postgres.log ---\n{log}")
        })
    }

    fn stop(&self, mode: &str) -> anyhow::Result<()> {
        run(
            &self.bin,
            self.as_postgres,
            "pg_ctl",
            &["stop", "-w", "-m", mode, "-D", path_str(&self.data)],
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop("immediate");
    }
}

/// Connects, retrying for a while: a server just started (or restarted) may take a
/// moment to accept connections.
async fn connect_with_retry(url: &str) -> sqlx::PgConnection {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match sqlx::PgConnection::connect(url).await {
            Ok(conn) => return conn,
            Err(error) if Instant::now() < deadline => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("connecting to {url}: {error}"),
        }
    }
}

/// Where `initdb` and `pg_ctl` live: on PATH, or in Debian's
/// `/usr/lib/postgresql/<version>/bin` (the newest version there).
fn postgres_bin() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                return Ok(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| {
            anyhow::anyhow!(
                "initdb is not installed: install Debian's postgresql package, or set \
                 GRADFLOW_TEST_POSTGRES_URL"
            )
        })?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| anyhow::anyhow!("no initdb under /usr/lib/postgresql/*/bin"))
}

/// Runs one of the PostgreSQL programs, as the `postgres` user when this process
/// is root.
fn run(bin: &Path, as_postgres: bool, program: &str, args: &[&str]) -> anyhow::Result<()> {
    let program = bin.join(program);
    let mut command = if as_postgres {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(&program);
        command
    } else {
        Command::new(&program)
    };
    let output = command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("running {}: {e}", program.display()))?;
    if !output.status.success() {
        anyhow::bail!(
            "{} {} failed ({}): {}{}",
            program.display(),
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Gives `dir` to the `postgres` user (the cluster's files must be its own).
fn chown_to_postgres(dir: &Path) -> anyhow::Result<()> {
    let status = Command::new("chown")
        .args(["postgres:postgres", path_str(dir)])
        .status()?;
    anyhow::ensure!(status.success(), "chown postgres {} failed", dir.display());
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

/// A short random name part.
fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    hasher.finish() % 1_000_000_000
}
