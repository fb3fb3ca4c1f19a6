//! Memory the server gives back while idle, and where glibc puts large buffers.

/// How long the engine waits with nothing to do before it gives freed memory back.
pub(crate) const TRIM_AFTER_IDLE: std::time::Duration = std::time::Duration::from_millis(500);

/// Hands the heap's free pages back to the OS (glibc's `malloc_trim`), so that an idle
/// server holds what it uses — the weights and the caches of live sequences — and not what
/// the allocator kept from finished requests (≈ 100 MiB, varying from one burst of requests
/// to the next). A no-op on other C libraries.
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        #[allow(unsafe_code)]
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: glibc's `malloc_trim` takes any padding, touches only the allocator's own
        // free lists and is thread-safe; nothing is read back.
        #[allow(unsafe_code)]
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Buffers from this size up get pages of their own (see [`keep_large_buffers_apart`]).
const MMAP_THRESHOLD: std::ffi::c_int = 4 << 20;

/// Fixes glibc's mmap threshold at [`MMAP_THRESHOLD`] (`mallopt(M_MMAP_THRESHOLD)`). By
/// default glibc raises the threshold to the size of each large buffer freed (up to 32 MiB),
/// so that a prompt chunk's activations or a batch's logits, once freed, are carved from the
/// heaps afterwards, and what the heaps keep — and so the resident memory of an idle server —
/// then varies by tens of MiB from one burst of requests to the next. With the threshold
/// fixed, buffers of 4 MiB and more are mapped on their own and returned whole when freed,
/// smaller ones come from the heaps as before (measured in `docs/benchmarks.md`: after the
/// first round of the load test, the idle resident memory stays within a few MiB; throughput
/// unchanged within the machine's noise).
/// Call it first, before the weights load: the heaps then never take large buffers. A
/// no-op on other C libraries.
pub fn keep_large_buffers_apart() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// glibc's `M_MMAP_THRESHOLD` (`malloc.h`).
        const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
        #[allow(unsafe_code)]
        unsafe extern "C" {
            fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
        }
        // SAFETY: glibc's `mallopt` only sets an allocator parameter (under the allocator's
        // own lock); any value within `0..=HEAP_MAX_SIZE / 2` is valid and 4 MiB is.
        #[allow(unsafe_code)]
        let ok = unsafe { mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
        if ok != 1 {
            tracing::warn!("mallopt(M_MMAP_THRESHOLD) refused: idle resident memory may vary more");
        }
    }
}
