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

/// Bytes of the database file `db` and its write-ahead log.
pub fn bytes_on_disk(db: &Path) -> u64 {
    let wal = db.with_extension("db-wal");
    [db, wal.as_path()]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}
