//! What one lock cycle costs besides time: allocations in this process (every thread,
//! the client's own included), and the server's own time per cycle from `INFO
//! commandstats`. Both are measured over a fixed number of back-to-back cycles, for
//! distlock and for a peer, in the same run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::scenarios::BenchResult;

/// The system allocator, counting every allocation (and reallocation) it serves.
pub struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on unchanged to the system allocator; the counter is the
// only addition.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we forward.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc`; `ptr` came from this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// What [`per_cycle`] measured.
pub struct Cost {
    pub allocations: f64,
    /// Server time per cycle, µs, summed over the top-level commands the caller named.
    pub server_micros: f64,
}

/// Cycles measured per implementation: enough to average out one-off allocations (a
/// histogram growing, a hash map resizing).
pub const CYCLES: u64 = 3000;

/// Runs `cycle` [`CYCLES`] times back to back and returns its cost per cycle. `top_level`
/// names the commands the implementation sends itself: commands a script calls are
/// counted by Redis too, but inside their script's time already.
pub async fn per_cycle<F, Fut>(
    stats: &mut MultiplexedConnection,
    top_level: &[&str],
    mut cycle: F,
) -> BenchResult<Cost>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = BenchResult<()>>,
{
    // Warm up: connections, script caches, lazily built state.
    for _ in 0..100 {
        cycle().await?;
    }
    settle().await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(stats)
        .await?;
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..CYCLES {
        cycle().await?;
    }
    // Work a cycle leaves to the background (batched latch deletion) belongs to it.
    settle().await;
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(stats)
        .await?;
    let server_micros: f64 = info
        .lines()
        .filter_map(|line| {
            let (command, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            if !top_level.contains(&command) {
                return None;
            }
            fields
                .split(',')
                .find_map(|field| field.strip_prefix("usec="))
                .and_then(|usec| usec.parse::<f64>().ok())
        })
        .sum();
    Ok(Cost {
        allocations: allocations as f64 / CYCLES as f64,
        server_micros: server_micros / CYCLES as f64,
    })
}

/// Lets background work of the last cycles finish (the latch drain lingers 10 ms).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(50)).await;
}
