//! What the load generator reads of the server it started
//! (`gradflow_e2e::ServerProcess`): its memory from Linux `/proc`, and the size of
//! its database.

use std::path::Path;

#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub resident: u64,
    pub peak: u64,
}

/// Resident memory of process `pid` now and at its peak, in bytes.
pub fn memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
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

/// CPU time process `pid` has used so far, every thread's, user and system, in
/// seconds: what tells a server working on one core from one working on all.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    // utime and stime are fields 14 and 15; the first after the name is field 3.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // In USER_HZ, which Linux fixes at 100 for /proc whatever the kernel's own tick.
    Some(ticks as f64 / 100.0)
}

/// Bytes of the database file `db` and its write-ahead log.
pub fn bytes_on_disk(db: &Path) -> u64 {
    let wal = db.with_extension("db-wal");
    [db, wal.as_path()]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}
