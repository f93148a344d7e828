/*
 * sandvisor-ram-discard.so: lets QEMU 7.2 give back the guest memory of a restored
 * clone or a resumed sandbox. Preloaded (LD_PRELOAD) into a QEMU whose guest RAM is a
 * private mapping of a sealed memfd (a mapped snapshot's memory, see
 * actors/machines/guestmem.py) or of a paused sandbox's saved memory, and which has a
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
 * A paused sandbox's resume maps its saved memory privately from the file itself (no
 * sealed copy: own_memory in actors/machines/guestmem.py), which the kernel lets QEMU
 * punch. That file is the sandbox's saved state until the resume is done: a resume
 * that fails, or whose supervisor is killed while its QEMU runs on, leaves the sandbox
 * paused on it. A punch there zeroes pages the resumed guest reports free -- free now,
 * not at the pause -- under the next resume. The supervisor names that file in QEMU's
 * environment: SANDVISOR_PRIVATE_RAM=<st_dev>:<st_ino>.
 *
 * So: a hole punch on a file sealed against writes, which the kernel refuses for
 * everyone, root included, or on the file named private RAM, returns success here
 * without a syscall. Nothing else is touched: every other fallocate (a disk's
 * discard) goes to the kernel as it was asked. This cannot change what any file holds
 * (a sealed file cannot be punched anyway, the private RAM must not be); it only lets
 * QEMU go on to its madvise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static int have_private;
static dev_t private_dev;
static ino_t private_ino;

/* read once, before QEMU's main: "<st_dev>:<st_ino>", both decimal; anything else is ignored */
__attribute__((constructor)) static void read_private_ram(void) {
    const char *v = getenv("SANDVISOR_PRIVATE_RAM");
    char *end;
    unsigned long long dev, ino;
    if (v == NULL || *v < '0' || *v > '9')
        return;
    errno = 0;
    dev = strtoull(v, &end, 10);
    if (errno != 0 || *end != ':' || end[1] < '0' || end[1] > '9')
        return;
    ino = strtoull(end + 1, &end, 10);
    if (errno != 0 || *end != '\0')
        return;
    private_dev = (dev_t)dev;
    private_ino = (ino_t)ino;
    have_private = 1;
}

static int sealed_against_writes(int fd) {
    int saved = errno;
    int seals = fcntl(fd, F_GET_SEALS);
    errno = saved;
    return seals >= 0 && (seals & F_SEAL_WRITE);
}

static int private_ram(int fd) {
    struct stat st;
    int saved = errno, is;
    if (!have_private)
        return 0;
    is = fstat(fd, &st) == 0 && st.st_dev == private_dev && st.st_ino == private_ino;
    errno = saved;
    return is;
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
    if ((mode & FALLOC_FL_PUNCH_HOLE) && (sealed_against_writes(fd) || private_ram(fd)))
        return 0;
    return (int)syscall(SYS_fallocate, fd, mode, offset, len);
}

/* QEMU is built with 64-bit offsets: it calls fallocate64 (the same on x86-64) */
int fallocate64(int fd, int mode, off_t offset, off_t len) __attribute__((alias("fallocate")));
