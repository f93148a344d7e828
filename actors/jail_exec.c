/*
 * sandvisor-jail-exec: enter a jail, then exec a program (QEMU). The fast path of
 * actors/cells/jail.py: the supervisor vforks this (no copy of its page tables, no Python
 * in a forked child) from a thread whose children start a new pid namespace, so it
 * runs as pid 1 there and its pid stays QEMU's. It makes the same syscalls, in the
 * same order, as jail.py's Python stage (_enter), from a plan jail.py writes as
 * arguments:
 *
 *   sandvisor-jail-exec --err-fd N [--cgroup-fd N]... [--netns-fd N] --unshare FLAGS
 *       [--mount SRC TARGET FSTYPE FLAGS DATA]...   ("" = NULL)
 *       --hostname NAME [--lo] --root DIR [--userns-fd N] [--keep-caps MASK]
 *       [--groups G,G] --gid G --uid U --last-cap N [--rlimit RESOURCE VALUE]...
 *       -- PROGRAM ARGS...
 *
 * --userns-fd: a user namespace entered after pivot_root (a tool's cell, see
 * actors/cells/toolcell.py): uid and gid are then the namespace's (0 allowed), and the
 * capabilities of --keep-caps are kept there (bounding set and permitted).
 *
 * A failure is written to the error fd as "step: strerror" and the exit status is 127;
 * on success the error fd is close-on-exec: the parent reads EOF once PROGRAM runs.
 * Built with `cc -O2 -static` by jail.build_helper(); not setuid, run by root only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_ITEMS 64

static int err_fd = 2;

static void fail(const char *step) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "%s: %s", step, strerror(errno));
    if (n > 0 && write(err_fd, buf, (size_t)n) < 0) { /* nothing more to say */ }
    _exit(127);
}

static void usage(const char *what) {
    errno = EINVAL;
    fail(what);
}

static long num(const char *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 0);
    if (errno || *end || end == s) usage("bad number in arguments");
    return v;
}

struct mnt { const char *src, *target, *fstype, *data; unsigned long flags; };

int main(int argc, char **argv) {
    int cgroup_fds[MAX_ITEMS], n_cgroups = 0, netns_fd = -1, userns_fd = -1, loopback = 0, last_cap = 63;
    unsigned long long keep_caps = 0;
    int rl_res[MAX_ITEMS], n_rl = 0;
    rlim_t rl_val[MAX_ITEMS];
    struct mnt mounts[MAX_ITEMS];
    int n_mounts = 0;
    long flags = -1, uid = -1, gid = -1;
    const char *hostname = NULL, *root = NULL, *groups_arg = "";
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
#define NEED(k) do { if (i + (k) >= argc) usage(a); } while (0)
        if (!strcmp(a, "--")) { i++; break; }
        else if (!strcmp(a, "--err-fd")) { NEED(1); err_fd = (int)num(argv[++i]); }
        else if (!strcmp(a, "--cgroup-fd")) { NEED(1); if (n_cgroups == MAX_ITEMS) usage(a); cgroup_fds[n_cgroups++] = (int)num(argv[++i]); }
        else if (!strcmp(a, "--netns-fd")) { NEED(1); netns_fd = (int)num(argv[++i]); }
        else if (!strcmp(a, "--userns-fd")) { NEED(1); userns_fd = (int)num(argv[++i]); }
        else if (!strcmp(a, "--keep-caps")) { NEED(1); keep_caps = (unsigned long long)num(argv[++i]); }
        else if (!strcmp(a, "--unshare")) { NEED(1); flags = num(argv[++i]); }
        else if (!strcmp(a, "--mount")) {
            NEED(5);
            if (n_mounts == MAX_ITEMS) usage(a);
            struct mnt *m = &mounts[n_mounts++];
            m->src = *argv[i + 1] ? argv[i + 1] : NULL;
            m->target = argv[i + 2];
            m->fstype = *argv[i + 3] ? argv[i + 3] : NULL;
            m->flags = (unsigned long)num(argv[i + 4]);
            m->data = *argv[i + 5] ? argv[i + 5] : NULL;
            i += 5;
        }
        else if (!strcmp(a, "--hostname")) { NEED(1); hostname = argv[++i]; }
        else if (!strcmp(a, "--lo")) loopback = 1;
        else if (!strcmp(a, "--root")) { NEED(1); root = argv[++i]; }
        else if (!strcmp(a, "--groups")) { NEED(1); groups_arg = argv[++i]; }
        else if (!strcmp(a, "--gid")) { NEED(1); gid = num(argv[++i]); }
        else if (!strcmp(a, "--uid")) { NEED(1); uid = num(argv[++i]); }
        else if (!strcmp(a, "--last-cap")) { NEED(1); last_cap = (int)num(argv[++i]); }
        else if (!strcmp(a, "--rlimit")) {
            NEED(2);
            if (n_rl == MAX_ITEMS) usage(a);
            rl_res[n_rl] = (int)num(argv[i + 1]);
            rl_val[n_rl++] = (rlim_t)num(argv[i + 2]);
            i += 2;
        }
        else usage(a);
    }
    if (i >= argc || flags < 0 || !root || !hostname) usage("missing arguments");
    if (userns_fd < 0 ? (uid <= 0 || gid <= 0) : (uid < 0 || gid < 0)) usage("missing arguments");

    for (int k = 0; k < n_cgroups; k++)
        if (write(cgroup_fds[k], "0", 1) != 1) fail("join the cgroup");
    if (unshare((int)flags)) fail("unshare namespaces");
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET)) fail("enter the network namespace");
    for (int k = 0; k < n_mounts; k++) {
        struct mnt *m = &mounts[k];
        if (mount(m->src, m->target, m->fstype, m->flags, m->data)) {
            char step[300];
            snprintf(step, sizeof step, "mount %s", m->target);
            fail(step);
        }
    }
    if (sethostname(hostname, strlen(hostname))) fail("sethostname");
    if (loopback) {
        struct ifreq ifr;
        int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (s < 0) fail("loopback up");
        memset(&ifr, 0, sizeof ifr);
        strcpy(ifr.ifr_name, "lo");
        ifr.ifr_flags = IFF_UP | IFF_LOOPBACK | IFF_RUNNING;
        if (ioctl(s, SIOCSIFFLAGS, &ifr)) fail("loopback up");
        close(s);
    }
    if (chdir(root) || syscall(SYS_pivot_root, ".", ".")) fail("pivot_root");
    if (umount2(".", MNT_DETACH)) fail("detach the old root");
    if (chdir("/")) fail("chdir /");
    if (userns_fd >= 0 && setns(userns_fd, CLONE_NEWUSER)) fail("enter the user namespace");

    gid_t groups[MAX_ITEMS];
    int n_groups = 0;
    for (const char *p = groups_arg; *p;) {
        char *end;
        long g = strtol(p, &end, 10);
        if (end == p || n_groups == MAX_ITEMS) usage("bad groups");
        groups[n_groups++] = (gid_t)g;
        if (*end == ',') end++;
        else if (*end) usage("bad groups");
        p = end;
    }
    if (setgroups((size_t)n_groups, groups)) fail("setgroups/setresgid");
    if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid)) fail("setgroups/setresgid");
    for (int c = 0; c <= last_cap; c++)
        if (!(c < 64 && (keep_caps >> c & 1)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0)) fail("drop the bounding set");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)) fail("clear ambient capabilities");
    for (int k = 0; k < n_rl; k++) {
        struct rlimit r = {rl_val[k], rl_val[k]};
        if (setrlimit(rl_res[k], &r)) fail("rlimits");
    }
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid)) fail("setresuid");
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    data[0].effective = data[0].permitted = (__u32)(keep_caps & 0xFFFFFFFFu);
    data[1].effective = data[1].permitted = (__u32)(keep_caps >> 32);
    if (syscall(SYS_capset, &hdr, data)) fail("capset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail("no_new_privs");
    umask(077);

    for (int k = 0; k < n_cgroups; k++) close(cgroup_fds[k]);
    if (netns_fd >= 0) close(netns_fd);
    if (userns_fd >= 0) close(userns_fd);
    if (fcntl(err_fd, F_SETFD, FD_CLOEXEC)) fail("close-on-exec");
    execv(argv[i], argv + i);
    fail("exec");
    return 127;
}
