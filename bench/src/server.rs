//! The real `gradflow-server`, started from beside the running program on a
//! temporary database and a free loopback port.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};

pub struct Server {
    child: Child,
    pub base: String,
    pub db: PathBuf,
}

impl Server {
    /// Starts `gradflow-server` on `db` with `extra` flags; waits until it listens.
    pub fn start(db: &Path, extra: &[&str]) -> anyhow::Result<Server> {
        let exe = std::env::current_exe().context("locating this program")?;
        let dir = exe.parent().context("this program has a directory")?;
        // Beside this program, or one level up when it runs from target/*/deps.
        let server = [dir.join("gradflow-server"), dir.join("../gradflow-server")]
            .into_iter()
            .find(|p| p.exists())
            .with_context(|| {
                format!(
                    "gradflow-server is not beside {}: build it (cargo build --release --bins)",
                    exe.display()
                )
            })?;
        let mut child = Command::new(&server)
            .args(["--listen", "127.0.0.1:0", "--db"])
            .arg(db)
            .args(extra)
            .env("RUST_LOG", "gradflow_server=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let stderr = child.stderr.take().context("piped stderr")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("gradflow-server listening")
                    && let Some(address) = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("address="))
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(address.to_owned());
                }
            }
        });
        let Ok(address) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            bail!("gradflow-server did not start listening within 30 s");
        };
        Ok(Server {
            child,
            base: format!("http://{address}"),
            db: db.to_owned(),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory now and at its peak, in bytes (Linux `/proc`).
    pub fn memory(&self) -> Option<Memory> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        };
        Some(Memory {
            resident: field("VmRSS:")?,
            peak: field("VmHWM:")?,
        })
    }

    /// Bytes of the database file and its write-ahead log.
    pub fn bytes_on_disk(&self) -> u64 {
        let wal = self.db.with_extension("db-wal");
        [self.db.as_path(), wal.as_path()]
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub resident: u64,
    pub peak: u64,
}
