//! Helpers for the end-to-end tests and the load generator: the real binaries,
//! started as a user would.

pub mod postgres;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// The path of a workspace binary in `target/<profile>/`: beside the running
/// program (a binary such as `gradflow-load`), or one folder up when the program
/// is a test executable in `target/<profile>/deps`. `cargo nextest run --workspace`
/// builds them.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the running program's path");
    let dir = exe.parent().expect("the running program has a folder");
    [dir.join(name), dir.join("..").join(name)]
        .into_iter()
        .find(|path| path.exists())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not built beside {}: run `cargo build --workspace --bins` first",
                exe.display()
            )
        })
}

/// A loopback address with a port free right now, for a server that must come back
/// on the same address after a restart.
pub fn free_loopback_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let port = listener.local_addr().expect("a bound address").port();
    format!("127.0.0.1:{port}")
}

/// The steps of `run` that hold a loss, in order, as `server` serves them.
pub async fn stored_loss_steps(
    client: &reqwest::Client,
    server: &ServerProcess,
    run: &str,
) -> Vec<u64> {
    let url = server.url(&format!("/api/v1/runs/{run}/series?metric=loss"));
    let body: serde_json::Value = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .expect("a series is JSON");
    body["points"]
        .as_array()
        .unwrap_or_else(|| panic!("no points in {body}"))
        .iter()
        .map(|p| p[0].as_u64().expect("a step number"))
        .collect()
}

/// Starts `gradflow-trainer` reporting run `run` to `servers` (one URL, or several
/// comma-separated), spooling into `dir`, with `args` after; its log (info level)
/// goes to `dir/{run}.log` — a file, not a pipe, so the trainer never blocks on it.
pub fn start_logged_trainer(dir: &Path, servers: &str, run: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{run}.log"))).expect("a trainer log file");
    Command::new(binary("gradflow-trainer"))
        .args(["--server", servers, "--run-id", run])
        .args(args)
        .arg("--spool-dir")
        .arg(dir)
        .arg("--quiet")
        .env("RUST_LOG", "gradflow_trainer=info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("gradflow-trainer starts")
}

/// What [`start_logged_trainer`] logged for `run` so far.
pub fn trainer_log(dir: &Path, run: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{run}.log"))).expect("the trainer's log")
}

/// The count the trainer's exit line gives after `label` ("delivered 140 steps (10
/// already there)": 140 after "delivered ", 10 after "steps (").
pub fn count_after(log: &str, label: &str) -> u64 {
    log.rsplit_once(label)
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count after {label:?} in the trainer's log:\n{log}"))
}

/// Waits for `child` to exit; panics, naming `what`, if it takes longer than `limit`.
pub fn wait_for_exit(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("polling a child process") {
            return status;
        }
        assert!(
            started.elapsed() < limit,
            "{what} did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `gradflow-server` process on a free loopback port.
pub struct ServerProcess {
    child: Child,
    pub base: String,
    logs: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Starts the server on `db` with extra flags, and waits until it listens.
    pub fn start(db: &Path, extra_args: &[&str]) -> ServerProcess {
        Self::start_at(db, "127.0.0.1:0", extra_args)
    }

    /// Starts the server on `db` listening on `listen`.
    pub fn start_at(db: &Path, listen: &str, extra_args: &[&str]) -> ServerProcess {
        Self::spawn([OsStr::new("--db"), db.as_os_str()], listen, extra_args)
    }

    /// Starts the server on the database `url` names (`--database`: a
    /// `postgres://` URL, or a SQLite file) listening on `listen`. It returns once the
    /// server listens: PostgreSQL is reached in the background, so the server may
    /// not be ready yet (`/readyz`).
    pub fn start_on_database(url: &str, listen: &str, extra_args: &[&str]) -> ServerProcess {
        Self::spawn(
            [OsStr::new("--database"), OsStr::new(url)],
            listen,
            extra_args,
        )
    }

    /// Starts the server with `database` (its flag and value), and waits until it
    /// listens.
    fn spawn(database: [&OsStr; 2], listen: &str, extra_args: &[&str]) -> ServerProcess {
        let mut child = Command::new(binary("gradflow-server"))
            .arg("--listen")
            .arg(listen)
            .args(database)
            .args(extra_args)
            .env("RUST_LOG", "gradflow_server=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("gradflow-server starts");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let kept = logs.clone();
        // Reads the log until the listening line, then keeps draining it (and keeping
        // it) so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                kept.lock().expect("log lock").push(line.clone());
                // Only the line that says it listens: warnings before it name the
                // address too.
                if line.contains("gradflow-server listening")
                    && let Some(address) = line
                        .split_whitespace()
                        .find_map(|word| word.strip_prefix("address="))
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(address.to_owned());
                }
            }
        });
        let address = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("gradflow-server logs its address within 30 s");
        ServerProcess {
            child,
            base: format!("http://{address}"),
            logs,
        }
    }

    /// What the server has logged so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().expect("log lock").clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown, no flush, no checkpoint.
    pub fn kill(mut self) {
        self.child.kill().expect("kill gradflow-server");
        self.child.wait().expect("reap gradflow-server");
    }

    /// SIGTERM, then waits for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("send SIGTERM");
        self.child.wait().expect("reap gradflow-server")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
