//! A run's values as columns: a step record flattened into one row of cells
//! ([`flatten`], [`columns`]), encoded cells ([`codec`]), the compressed 64-step
//! blocks the store keeps ([`block`]) and the rollups of coarser resolutions
//! ([`rollup`]). Pure: the store writes and reads the bytes this module makes.

pub mod block;
pub mod codec;
pub mod columns;
pub mod flatten;
pub mod rollup;
pub mod signal_cells;
