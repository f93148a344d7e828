/*
 * sandvisor-ram-discard.so: lets QEMU 7.2 give back the guest memory of a restored
 * clone. Preloaded (LD_PRELOAD) into a QEMU whose guest RAM is a private mapping of a
 * sealed memfd (a mapped snapshot's memory, see actors/machines/guestmem.py) and which has a
 * virtio-balloon with free page reporting.
 *
 * QEMU 7.2's ram_block_discard_range() (softmmu/physmem.c), which the balloon calls
 * for every free page range the guest reports, does, for RAM backed by a file:
 *
 *     fallocate(fd, PUNCH_HOLE | KEEP_SIZE, ...)   -- on failure: error, return
 *     madvise(host, len, MADV_DONTNEED)            -- drops this process's pages
 *
 * On a private mapping the hole punch is wrong (it would zero the snapshot's memory
 * under every other clone; the seal makes the kernel refuse it with EPERM) and the
 * madvise is exactly right (the private copies the guest wrote go; the pages read
 * from the snapshot's memory again, which a free page may). QEMU 8.1 stopped punching
 * private mappings; 7.2 gives up at the EPERM before its madvise, and logs a line.
 *
 * So: a hole punch on a file sealed against writes, which the kernel refuses for
 * everyone, root included, returns success here without a syscall. Nothing else is
 * touched: every other fallocate goes to the kernel as it was asked. This cannot
 * change what any file holds (a sealed file cannot be punched anyway); it only lets
 * QEMU go on to its madvise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/syscall.h>
#include <unistd.h>

static int sealed_against_writes(int fd) {
    int saved = errno;
    int seals = fcntl(fd, F_GET_SEALS);
    errno = saved;
    return seals >= 0 && (seals & F_SEAL_WRITE);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
    if ((mode & FALLOC_FL_PUNCH_HOLE) && sealed_against_writes(fd))
        return 0;
    return (int)syscall(SYS_fallocate, fd, mode, offset, len);
}

/* QEMU is built with 64-bit offsets: it calls fallocate64 (the same on x86-64) */
int fallocate64(int fd, int mode, off_t offset, off_t len) __attribute__((alias("fallocate")));
