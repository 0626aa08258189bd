/*
 * The checksums of many chunks in one call, for ppe_snapshot.engine._files.chunk_hashes.
 *
 * A plain C library, no Python API: it is called through ctypes, which releases the GIL for the whole call, so a
 * thread hashing thousands of small chunks (a restore's reads, a background save's checksums) runs beside the
 * Python code of other threads instead of taking turns with it. The hash function itself is the xxh3_64 of the
 * xxHash library the Python package xxhash carries; the caller passes its address.
 */
#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*ppe_hash_fn)(const void *data, size_t length);

/* out[i] = hash(addresses[i], lengths[i]) for every i below count. */
void ppe_hash_many(ppe_hash_fn hash, const uint64_t *addresses, const uint64_t *lengths, size_t count,
                   uint64_t *out) {
    for (size_t i = 0; i < count; i++) {
        out[i] = hash((const void *)(uintptr_t)addresses[i], (size_t)lengths[i]);
    }
}

/* The arguments of one ppe_hash_many call, for ppe_hash_job. */
struct ppe_hash_job {
    ppe_hash_fn hash;
    const uint64_t *addresses;
    const uint64_t *lengths;
    size_t count;
    uint64_t *out;
};

/* ppe_hash_many of a job: the function a local read runs once its bytes have landed, in the same native call
   (ppe_snapshot/storage/preadv_all.c), so that the read thread leaves the GIL once for both. */
void ppe_hash_job(const struct ppe_hash_job *job) {
    ppe_hash_many(job->hash, job->addresses, job->lengths, job->count, job->out);
}
