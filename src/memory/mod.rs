//! Memory: what a run uses and how the device's allocator is set up.
//!
//! - [`usage`]: memory in use and its peak, read from where it lives: the CUDA memory pool's
//!   counters and the card's free/total on CUDA, the process's resident set on the CPU.
//! - [`device_setup`]: one-time settings for a CUDA device before training (pool caching, event
//!   tracking).
//! - [`trim`]: giving freed pool memory back after an out-of-memory error.
//! - [`vram_cap`]: `vram_limit_gb`, a big card made to behave like a small one.
//! - [`watch`]: a memory creep and slow steps during a run, told from spikes.

pub mod device_choice;
pub mod device_setup;
pub mod trim;
pub mod usage;
pub mod vram_cap;
pub mod watch;

pub use device_choice::{cuda_cards, open_device, DeviceError, DeviceRequest};
pub use device_setup::{prepare_device, DeviceSettings};
pub use trim::trim_pool;
pub use usage::{MemorySource, MemoryUsage};
pub use watch::{StepWatch, WatchEvent};
