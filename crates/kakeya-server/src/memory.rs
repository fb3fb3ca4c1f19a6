//! Memory the server gives back while idle.

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
