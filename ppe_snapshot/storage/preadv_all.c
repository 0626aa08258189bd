/*
 * A vectored read of many pieces of a local file in one call, for ppe_snapshot.storage.local_reads.
 *
 * A plain C library, no Python API: it is called through ctypes, which releases the GIL for the whole call. The
 * pieces take as many system calls as they need (at most IOV_MAX pieces each, resumed after a short read or a
 * signal), and once all have landed a function the caller names runs on the same thread (the engine checks what
 * was read): a read thread leaves the GIL once per read instead of once per system call and once more for its
 * checks, and so waits less often for it to come back while another thread runs Python.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef ssize_t (*ppe_preadv_fn)(int fd, const struct iovec *iov, int count, off_t offset);
typedef void (*ppe_then_fn)(void *argument);

enum { PPE_IOV_MAX = 1024 };

/*
 * Fill iov[0..count) in order from the bytes of fd at offset, through preadv_fn (the C library's preadv; a test
 * passes one that stops short). iov is changed as the read goes on. Returns 0 once every byte is read, after
 * then(argument) where then is not NULL; the errno of a failed call; or -1 where the file ends first. *done is
 * the count of bytes read.
 */
int ppe_preadv_all(ppe_preadv_fn preadv_fn, int fd, struct iovec *iov, size_t count, int64_t offset,
                   ppe_then_fn then, void *argument, int64_t *done) {
    *done = 0;
    for (;;) {
        while (count > 0 && iov->iov_len == 0) {
            iov++;
            count--;
        }
        if (count == 0) {
            break;
        }
        ssize_t n = preadv_fn(fd, iov, count > PPE_IOV_MAX ? PPE_IOV_MAX : (int)count, (off_t)offset);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        if (n == 0) {
            return -1;
        }
        offset += n;
        *done += n;
        size_t left = (size_t)n;
        while (left >= iov->iov_len) {  /* (a piece is left: n is at most the bytes the call was given) */
            left -= iov->iov_len;
            iov++;
            count--;
            if (count == 0) {
                break;
            }
        }
        if (count > 0 && left > 0) {  /* a short read within a piece: the rest of it next */
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    if (then != NULL) {
        then(argument);
    }
    return 0;
}
