/*
 * fake_nvml.c -- a fake libnvidia-ml.so.1 for testing gpuwatch without a GPU.
 *
 * Build (the Python harness tests/fakenvml/__init__.py does this for you):
 *
 *   cc -shared -fPIC -O2 -Wall -Wextra -Wl,-soname,libnvidia-ml.so.1 \
 *      -o <dir>/libnvidia-ml.so.1 fake_nvml.c -lpthread
 *
 * Add -DFAKE_OLD_DRIVER to get a library that looks like an older driver: the
 * "NEW" symbols (see NEW_SYMBOL below) are not exported at all, so pynvml
 * raises NVMLError_FunctionNotFound for them, and nvmlDeviceGetFieldValues
 * answers every field id > 200 with a per-entry NVML_ERROR_INVALID_ARGUMENT.
 *
 * The real pynvml binding loads this library with CDLL("libnvidia-ml.so.1"),
 * so put its directory first on LD_LIBRARY_PATH *before* the Python process
 * starts.
 *
 * Environment
 * -----------
 *   FAKE_NVML_STATE   path of the state file (below). Read again in every
 *                     nvmlInitWithFlags and, while running, whenever its
 *                     mtime (ns) / size / inode changes; the file is stat()ed
 *                     at most every 50 ms (CLOCK_MONOTONIC), so tight loops
 *                     stay cheap (FAKE_NVML_RECHECK_MS sets that period;
 *                     0: every call stats it, so a process that rewrites
 *                     the file sees the change on its next call: the
 *                     in-process harness's child). If the variable is unset or the file has
 *                     never been readable, nvmlInitWithFlags returns
 *                     NVML_ERROR_DRIVER_NOT_LOADED (9). A file that becomes
 *                     unreadable later keeps the last good state.
 *   FAKE_NVML_COUNTS  optional path of a call-count file. It is created (or
 *                     reused) and mmap'd MAP_SHARED: a table of 128 entries
 *                     of { char name[56]; uint64_t count; } (64 bytes each,
 *                     8192 bytes total, host byte order). Entry i holds the
 *                     C symbol name and the number of calls to it (atomic
 *                     increments; every call is counted, including failed
 *                     ones). Another process can read it at any time.
 *   FAKE_NVML_CPU     1: entry "__cpu_ns__" of that table sums the CPU time
 *                     threads spent inside the library's calls (benchmarks).
 *
 * State file format
 * -----------------
 * Plain text, one setting per line: "key arg arg ...". Blank lines and lines
 * whose first non-blank character is '#' are ignored. Numbers are decimal
 * (may be negative) or 0x-prefixed hex. Lines before the first "gpu N" line
 * are global; "gpu N" starts the section for GPU N (0..63) and every
 * following line applies to that GPU until the next "gpu" (or "global").
 * A per-GPU reading whose key is ABSENT is reported as NVML_ERROR_NOT_SUPPORTED
 * (3). Unknown keys are reported on stderr and ignored.
 *
 * Global keys:
 *   init_error <code>            nvmlInitWithFlags returns <code> (0 = ok)
 *   driver_version <string>      nvmlSystemGetDriverVersion
 *   nvml_version <string>        nvmlSystemGetNVMLVersion
 *   cuda_version <int>           nvmlSystemGetCudaDriverVersion (e.g. 13010)
 *   cuda_version_v2 <int>        ..._v2 (defaults to cuda_version)
 *   gpu_count <n>                nvmlDeviceGetCount_v2 (default: highest
 *                                "gpu" index + 1)
 *   fieldvalues_all_failed <c>   what nvmlDeviceGetFieldValues returns when no
 *                                entry succeeded (default: the first entry's
 *                                per-entry code; 0 = SUCCESS anyway)
 *   xid_after_register <0|1>     1: an event set only gets XIDs whose seq is
 *                                greater than the newest one queued for that
 *                                GPU when it was registered (like real NVML);
 *                                0 (default): it gets every queued XID once
 *   error <symbol|*> <code>      every call of <symbol> (any GPU, and the
 *                                system functions) returns <code>;
 *                                "*" = every symbol except nvmlInitWithFlags,
 *                                nvmlInit_v2, nvmlShutdown, nvmlErrorString
 *   unsupported <symbol>         same as "error <symbol> 3"
 *   block <symbol|*> <ms>        calls to <symbol> sleep <ms> before doing
 *                                anything (ms < 0: until the line is removed).
 *                                The state is re-checked while sleeping, so
 *                                removing/changing the line ends the block
 *                                early. The library mutex is NOT held.
 *
 * Per-GPU keys (after "gpu <index>"):
 *   uuid|name|serial|vbios <string to end of line>
 *   pci_bus_id <dddddddd:bb:dd.f>          nvmlDeviceGetPciInfo_v3 busId etc.
 *   minor <n>  architecture <n>  brand <n>  persistence <0|1>
 *   pci_device_id <n>  pci_subsystem_id <n>  cuda_cc <major> <minor>
 *   temperature <C>                          GetTemperature / GetTemperatureV
 *   margin_temperature <C>                   GetMarginTemperature (signed)
 *   threshold <type 0..7> <C>                GetTemperatureThreshold
 *   fan <i> <speed%> <target%> <rpm>         one line per fan; the number of
 *                                            fans is highest i + 1 (no fan
 *                                            line: fan calls NOT_SUPPORTED);
 *                                            "na" = that reading NOT_SUPPORTED
 *   power_usage <mW>  total_energy <mJ>  enforced_power_limit <mW>
 *   power_limit <mW>  default_power_limit <mW>
 *   power_limit_constraints <min mW> <max mW>
 *   pstate <0..15|32>
 *   utilization <gpu%> <mem%>
 *   encoder_utilization <util%> <period us>  decoder_utilization <..> <..>
 *   memory <total> <reserved> <used>         bytes. v2: used excludes reserved,
 *                                            free = total - reserved - used;
 *                                            v1: used = used + reserved
 *   clock <type 0..3> <MHz>  max_clock <type 0..3> <MHz>
 *   clocks_event_reasons <mask>  supported_clocks_event_reasons <mask>
 *                                            (also the *ThrottleReasons calls)
 *   pcie_gen <n> pcie_width <n> pcie_max_gen <n> pcie_max_width <n>
 *   pcie_replay <n>
 *   ecc_mode <current> <pending>
 *   ecc_errors <errType 0|1> <counterType 0|1> <count>
 *   remapped_rows <corr> <unc> <pending> <failure>
 *   retired_pages_pending <0|1>
 *   supported_event_types <mask>             (registering other types fails)
 *   field <id> <type> <value>                nvmlDeviceGetFieldValues entry;
 *                                            type: d ui ul ull sll si us (or
 *                                            0..6). Ids without a "field" line
 *                                            give per-entry NOT_SUPPORTED.
 *   field_error <id> <code>                  per-entry nvmlReturn for <id>
 *   field_min_batch <id> <n>                 <id>'s "field" line answers only in
 *                                            a call of at least <n> entries; a
 *                                            smaller call gets NOT_SUPPORTED (an
 *                                            H200 on R580.159 answers field 258
 *                                            with a double 0.0 in a batch of 35
 *                                            ids, NOT_SUPPORTED alone or in 15)
 *   lost <0|1>                               1: every per-device call (and
 *                                            GetHandleByIndex/UUID/PciBusId for
 *                                            it) returns NVML_ERROR_GPU_IS_LOST
 *   error <symbol|*> <code>  unsupported <symbol>  block <symbol|*> <ms>
 *                                            as above, only for this GPU
 *   process compute|graphics <pid> <bytes|na>
 *                                            Get{Compute,Graphics}Running
 *                                            Processes_v2/_v3 entries
 *   xid <seq> <xid>                          queued XID event; seq must be
 *                                            unique and increasing
 *   c2c_mode <0|1>                           nvmlDeviceGetC2cModeInfoV
 *   nvlink_version <enum>                    nvmlDeviceGetNvLinkVersion (any link: NVML_NVLINK_VERSION_*,
 *                                            6 = 4.0, 7 = 5.0); absent: NOT_SUPPORTED
 *                                            isC2cEnabled (absent: NOT_SUPPORTED)
 *
 * Precedence for a per-device call: block (sleep) -> not initialised (1) ->
 * bad handle / index >= gpu_count (2) -> lost (15) -> per-GPU error for the
 * symbol -> per-GPU "*" error -> global error for the symbol -> global "*"
 * -> the reading itself (absent key = 3).
 *
 * Events: nvmlEventSetWait_v2 waits up to timeoutms (asleep until the state
 * file changes, as a real driver sleeps in the kernel until an event comes:
 * see wait_for_state) for a queued XID on a device registered for nvmlEventTypeXidCriticalError
 * (0x8) in that set, and delivers each XID once per event set (eventType 0x8,
 * eventData = xid, device = that GPU's handle, instance ids 0xFFFFFFFF).
 * Otherwise it returns NVML_ERROR_TIMEOUT (10).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* NVML types (ABI-compatible subset of nvml.h)                              */
/* ------------------------------------------------------------------------ */

typedef int nvmlReturn_t;
typedef struct fake_dev *nvmlDevice_t;
typedef struct fake_evset *nvmlEventSet_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t; /* 40 bytes */

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;

typedef struct {
    unsigned int version;
    int marginTemperature;
} nvmlMarginTemperature_v1_t;

typedef struct {
    unsigned int version;
    unsigned int fan;
    unsigned int speed;
} nvmlFanSpeedInfo_v1_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* == nvmlProcessInfo_v2_t, 24 bytes */

#define STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24U)))
#define nvmlTemperature_v1 STRUCT_VERSION(nvmlTemperature_v1_t, 1)             /* 0x0100000C */
#define nvmlMarginTemperature_v1 STRUCT_VERSION(nvmlMarginTemperature_v1_t, 1) /* 0x01000008 */
#define nvmlFanSpeedInfo_v1 STRUCT_VERSION(nvmlFanSpeedInfo_v1_t, 1)           /* 0x0100000C */
#define nvmlMemory_v2 STRUCT_VERSION(nvmlMemory_v2_t, 2)                       /* 0x02000028 */

#define XID_EVENT 0x8ULL
#define NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NO_INSTANCE 0xFFFFFFFFU

/* ------------------------------------------------------------------------ */
/* Symbols (for call counts, error injection and blocking)                   */
/* ------------------------------------------------------------------------ */

/* X(name) for every exported function; order = slot in the counts table. */
#define FAKE_SYMBOLS(X)                                                        \
    X(nvmlInitWithFlags)                                                       \
    X(nvmlInit_v2)                                                             \
    X(nvmlShutdown)                                                            \
    X(nvmlErrorString)                                                         \
    X(nvmlSystemGetDriverVersion)                                              \
    X(nvmlSystemGetNVMLVersion)                                                \
    X(nvmlSystemGetCudaDriverVersion)                                          \
    X(nvmlSystemGetCudaDriverVersion_v2)                                       \
    X(nvmlDeviceGetCount_v2)                                                   \
    X(nvmlDeviceGetHandleByIndex_v2)                                           \
    X(nvmlDeviceGetHandleByUUID)                                               \
    X(nvmlDeviceGetHandleByPciBusId_v2)                                        \
    X(nvmlDeviceGetUUID)                                                       \
    X(nvmlDeviceGetName)                                                       \
    X(nvmlDeviceGetPciInfo_v3)                                                 \
    X(nvmlDeviceGetSerial)                                                     \
    X(nvmlDeviceGetMinorNumber)                                                \
    X(nvmlDeviceGetVbiosVersion)                                               \
    X(nvmlDeviceGetArchitecture)                                               \
    X(nvmlDeviceGetIndex)                                                      \
    X(nvmlDeviceGetBrand)                                                      \
    X(nvmlDeviceGetCudaComputeCapability)                                      \
    X(nvmlDeviceGetPersistenceMode)                                            \
    X(nvmlDeviceGetTemperatureV)                                               \
    X(nvmlDeviceGetTemperature)                                                \
    X(nvmlDeviceGetMarginTemperature)                                          \
    X(nvmlDeviceGetTemperatureThreshold)                                       \
    X(nvmlDeviceGetNumFans)                                                    \
    X(nvmlDeviceGetFanSpeed)                                                   \
    X(nvmlDeviceGetFanSpeed_v2)                                                \
    X(nvmlDeviceGetTargetFanSpeed)                                             \
    X(nvmlDeviceGetFanSpeedRPM)                                                \
    X(nvmlDeviceGetPowerUsage)                                                 \
    X(nvmlDeviceGetTotalEnergyConsumption)                                     \
    X(nvmlDeviceGetEnforcedPowerLimit)                                         \
    X(nvmlDeviceGetPowerManagementLimit)                                       \
    X(nvmlDeviceGetPowerManagementDefaultLimit)                                \
    X(nvmlDeviceGetPowerManagementLimitConstraints)                            \
    X(nvmlDeviceGetPerformanceState)                                           \
    X(nvmlDeviceGetUtilizationRates)                                           \
    X(nvmlDeviceGetEncoderUtilization)                                         \
    X(nvmlDeviceGetDecoderUtilization)                                         \
    X(nvmlDeviceGetMemoryInfo)                                                 \
    X(nvmlDeviceGetMemoryInfo_v2)                                              \
    X(nvmlDeviceGetClockInfo)                                                  \
    X(nvmlDeviceGetMaxClockInfo)                                               \
    X(nvmlDeviceGetCurrentClocksEventReasons)                                  \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)                               \
    X(nvmlDeviceGetSupportedClocksEventReasons)                                \
    X(nvmlDeviceGetSupportedClocksThrottleReasons)                             \
    X(nvmlDeviceGetCurrPcieLinkGeneration)                                     \
    X(nvmlDeviceGetCurrPcieLinkWidth)                                          \
    X(nvmlDeviceGetMaxPcieLinkGeneration)                                      \
    X(nvmlDeviceGetMaxPcieLinkWidth)                                           \
    X(nvmlDeviceGetPcieReplayCounter)                                          \
    X(nvmlDeviceGetRemappedRows)                                               \
    X(nvmlDeviceGetRetiredPagesPendingStatus)                                  \
    X(nvmlDeviceGetTotalEccErrors)                                             \
    X(nvmlDeviceGetEccMode)                                                    \
    X(nvmlDeviceGetFieldValues)                                                \
    X(nvmlEventSetCreate)                                                      \
    X(nvmlDeviceGetSupportedEventTypes)                                        \
    X(nvmlDeviceRegisterEvents)                                                \
    X(nvmlEventSetWait_v2)                                                     \
    X(nvmlEventSetFree)                                                        \
    X(nvmlDeviceGetComputeRunningProcesses_v3)                                 \
    X(nvmlDeviceGetComputeRunningProcesses_v2)                                 \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3)                                \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2)                                 \
    X(nvmlGpmQueryDeviceSupport)                                               \
    X(nvmlGpmSampleAlloc)                                                      \
    X(nvmlGpmSampleFree)                                                       \
    X(nvmlGpmSampleGet)                                                        \
    X(nvmlGpmMetricsGet)                                                       \
    X(nvmlDeviceGetGpuFabricInfo)                                              \
    X(nvmlDeviceGetGpuFabricInfoV)                                             \
    X(nvmlDeviceGetNvLinkRemoteDeviceType)                                     \
    X(nvmlDeviceGetNvLinkRemotePciInfo_v2)                                     \
    X(nvmlDeviceGetMigMode)                                                    \
    X(nvmlDeviceGetMaxMigDeviceCount)                                          \
    X(nvmlDeviceGetMigDeviceHandleByIndex)                                     \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle)                            \
    X(nvmlDeviceIsMigDeviceHandle)                                             \
    X(nvmlDeviceGetGpuInstanceId)                                              \
    X(nvmlDeviceGetComputeInstanceId)                                          \
    X(nvmlGpmMigSampleGet)                                                     \
    X(nvmlDeviceGetC2cModeInfoV)                                               \
    X(nvmlDeviceGetNvLinkVersion)

#define SYM_ENUM(name) SYM_##name,
enum { FAKE_SYMBOLS(SYM_ENUM) NSYM };
#define SYM_NAME(name) #name,
static const char *const g_sym_names[NSYM] = {FAKE_SYMBOLS(SYM_NAME)};

/* Symbols of newer drivers: not exported with -DFAKE_OLD_DRIVER. */
#ifdef FAKE_OLD_DRIVER
#define NEW_SYMBOL 0
#else
#define NEW_SYMBOL 1
#endif

/* ------------------------------------------------------------------------ */
/* Call counts (shared memory table)                                         */
/* ------------------------------------------------------------------------ */

#define COUNT_SLOTS 128
typedef struct {
    char name[56];
    uint64_t count;
} count_slot_t;
_Static_assert(sizeof(count_slot_t) == 64, "count slot must be 64 bytes");
_Static_assert(NSYM <= COUNT_SLOTS, "too many symbols for the count table");

static count_slot_t *g_counts; /* NULL when FAKE_NVML_COUNTS is unset */
#define CPU_SLOT NSYM /* "__cpu_ns__", see FAKE_NVML_CPU */
_Static_assert(NSYM + 1 <= COUNT_SLOTS, "no slot left for the CPU time");
static int g_cpu_timing;

static void counts_open(void)
{
    const char *path = getenv("FAKE_NVML_COUNTS");
    if (!path || !*path)
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "fake_nvml: cannot open FAKE_NVML_COUNTS %s: %s\n", path, strerror(errno));
        return;
    }
    size_t bytes = sizeof(count_slot_t) * COUNT_SLOTS;
    struct stat sb;
    if (fstat(fd, &sb) == 0 && (size_t)sb.st_size < bytes && ftruncate(fd, (off_t)bytes) != 0) {
        fprintf(stderr, "fake_nvml: cannot size %s: %s\n", path, strerror(errno));
        close(fd);
        return;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        fprintf(stderr, "fake_nvml: cannot mmap %s: %s\n", path, strerror(errno));
        return;
    }
    count_slot_t *t = p;
    for (int i = 0; i < NSYM; i++) {
        if (strncmp(t[i].name, g_sym_names[i], sizeof t[i].name) != 0) {
            char buf[56] = {0};
            strncpy(buf, g_sym_names[i], sizeof buf - 1);
            memcpy(t[i].name, buf, sizeof buf);
        }
    }
    if (strncmp(t[CPU_SLOT].name, "__cpu_ns__", sizeof t[CPU_SLOT].name) != 0) {
        char buf[56] = {0};
        strncpy(buf, "__cpu_ns__", sizeof buf - 1);
        memcpy(t[CPU_SLOT].name, buf, sizeof buf);
    }
    const char *cpu = getenv("FAKE_NVML_CPU");
    g_cpu_timing = cpu && *cpu && *cpu != '0';
    g_counts = t;
}

/* With FAKE_NVML_CPU=1 the table's slot NSYM ("__cpu_ns__") sums the CPU time threads spent inside
 * the library's calls (CLOCK_THREAD_CPUTIME_ID, from a call's entry to its unlock): what a benchmark
 * takes off a process's CPU time to get the cost of the process itself. Calls that return before
 * taking the lock (argument errors) are not timed. */
static __thread long long t_cpu_entered;

static inline long long thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void count_call(int sym)
{
    if (g_counts) {
        __atomic_fetch_add(&g_counts[sym].count, 1, __ATOMIC_RELAXED);
        if (g_cpu_timing)
            t_cpu_entered = thread_cpu_ns();
    }
}

/* The CPU time of the call in progress since its entry or the last count: at its end (count_cpu), and in a
 * long nvmlEventSetWait_v2 at each of its wake-ups, so that a benchmark's window that ends inside the wait
 * finds it counted, not seconds later at the call's end (with the count only at the end, a window's figure
 * moved by up to a wait's CPU at each of its edges). */
static inline void count_cpu_so_far(void)
{
    if (g_counts && g_cpu_timing && t_cpu_entered) {
        long long now = thread_cpu_ns();
        __atomic_fetch_add(&g_counts[CPU_SLOT].count, (uint64_t)(now - t_cpu_entered), __ATOMIC_RELAXED);
        t_cpu_entered = now;
    }
}

static inline void count_cpu(void)
{
    count_cpu_so_far();
    t_cpu_entered = 0;
}

/* ------------------------------------------------------------------------ */
/* State                                                                     */
/* ------------------------------------------------------------------------ */

#define MAX_GPUS 64
#define MAX_FANS 16
#define MAX_FIELDS 1024
#define MAX_GPM 48
#define MAX_LINKS 36 /* NVML_NVLINK_MAX_LINKS */
#define MAX_MIG 7    /* MIG devices per GPU (NVML_MAX_MIG_DEVICES_PER_GPU... on an H100: 7) */
#define MAX_MIG_GPM 16
#define MAX_PROCS 64
#define MAX_XIDS 4096
#define STR_LEN 96
#define NA LLONG_MIN /* "na" in the state file */

/* Scalar per-GPU keys: name, enum, number of values. */
#define GPU_KEYS(K)                                                            \
    K(minor, 1)                                                                \
    K(architecture, 1)                                                         \
    K(brand, 1)                                                                \
    K(persistence, 1)                                                          \
    K(pci_device_id, 1)                                                        \
    K(pci_subsystem_id, 1)                                                     \
    K(cuda_cc, 2)                                                              \
    K(temperature, 1)                                                          \
    K(margin_temperature, 1)                                                   \
    K(power_usage, 1)                                                          \
    K(total_energy, 1)                                                         \
    K(enforced_power_limit, 1)                                                 \
    K(power_limit, 1)                                                          \
    K(default_power_limit, 1)                                                  \
    K(power_limit_constraints, 2)                                              \
    K(pstate, 1)                                                               \
    K(utilization, 2)                                                          \
    K(encoder_utilization, 2)                                                  \
    K(decoder_utilization, 2)                                                  \
    K(memory, 3)                                                               \
    K(clocks_event_reasons, 1)                                                 \
    K(supported_clocks_event_reasons, 1)                                       \
    K(pcie_gen, 1)                                                             \
    K(pcie_width, 1)                                                           \
    K(pcie_max_gen, 1)                                                         \
    K(pcie_max_width, 1)                                                       \
    K(pcie_replay, 1)                                                          \
    K(ecc_mode, 2)                                                             \
    K(remapped_rows, 4)                                                        \
    K(retired_pages_pending, 1)                                                \
    K(supported_event_types, 1)                                                \
    K(gpm_supported, 1)                                                        \
    K(fabric, 4)                                                               \
    K(fabric_summary, 1)                                                       \
    K(mig_mode, 2)                                                             \
    K(c2c_mode, 1)                                                             \
    K(nvlink_version, 1)                                                       \
    K(lost, 1)

#define KEY_ENUM(name, n) K_##name,
enum { GPU_KEYS(KEY_ENUM) NKEYS };
#define KEY_INFO(name, n) {#name, n},
static const struct {
    const char *name;
    int nvals;
} g_keys[NKEYS] = {GPU_KEYS(KEY_INFO)};
_Static_assert(NKEYS <= 64, "present mask is 64 bits");

enum { S_UUID, S_NAME, S_SERIAL, S_VBIOS, S_PCI_BUS_ID, S_FABRIC_CLUSTER, NSTR };
static const char *const g_str_keys[NSTR] = {"uuid", "name", "serial", "vbios", "pci_bus_id",
                                             "fabric_cluster_uuid"};

typedef struct {
    unsigned int id;
    unsigned int scope; /* scopeId: a link, a power scope; 0 unless given as id:scope */
    unsigned int type;
    int err;       /* per-entry error (field_error); 0 = none */
    int has_value; /* a "field" line was seen */
    int min_batch; /* field_min_batch: answers only in calls of at least this many entries */
    nvmlValue_t value;
} field_t;

typedef struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci; /* MIG instance ids, NO_INSTANCE when not on MIG */
} proc_t;

typedef struct {
    int present;
    unsigned int gi, ci;
    long long total, used; /* bytes */
    char uuid[STR_LEN];
    char name[STR_LEN];
    int ngpm;
    unsigned int gpm_id[MAX_MIG_GPM];
    double gpm_value[MAX_MIG_GPM];
} mig_t;

typedef struct {
    int gpu;
    long long seq;
    unsigned long long xid;  /* eventData */
    unsigned long long type; /* eventType: XID_EVENT for "xid" lines */
} xid_t;

typedef struct {
    uint64_t present; /* bit K_x set when key x was given */
    long long v[NKEYS][4];
    unsigned str_present;
    char str[NSTR][STR_LEN];
    unsigned int pci_domain, pci_bus, pci_dev;
    long long threshold[8];
    unsigned threshold_has;
    long long clock[4], max_clock[4];
    unsigned clock_has, max_clock_has;
    int num_fans;
    long long fan_speed[MAX_FANS], fan_target[MAX_FANS], fan_rpm[MAX_FANS];
    long long ecc[2][2];
    unsigned ecc_has;
    int nfields;
    field_t fields[MAX_FIELDS];
    int ngpm;
    unsigned int gpm_id[MAX_GPM];
    double gpm_value[MAX_GPM];
    mig_t mig[MAX_MIG];
    uint64_t nvl_remote_has; /* bit l: an nvlink_remote line for link l */
    unsigned int nvl_remote_type[MAX_LINKS];
    char nvl_remote_bus[MAX_LINKS][32];
    int err[NSYM], err_all;
    int block_ms[NSYM], block_all;
    int nproc[2];
    proc_t procs[2][MAX_PROCS];
} gpu_t;

typedef struct {
    int init_error;
    char driver_version[80];
    char nvml_version[80];
    long long cuda_version, cuda_version_v2;
    int gpu_count;
    int fv_all_failed; /* -1: first entry's code */
    int xid_after_register;
    int err[NSYM], err_all;
    int block_ms[NSYM], block_all;
    int nxid;
    xid_t xids[MAX_XIDS];
    gpu_t gpus[MAX_GPUS];
} state_t;

struct fake_dev {
    int index;
    int pad;
};

struct fake_evset {
    unsigned int magic;
    unsigned long long mask[MAX_GPUS];
    long long last_seq[MAX_GPUS];
    /* the set's inotify watch on the state file, made at its first wait and closed when it is freed (a real
     * event set holds its descriptors for its life too): -1 none yet (or inotify refused: tried again at the
     * next wait). Two threads waiting on one set share it: the one that reads an event wakes at once, the
     * other at its next recheck (EVENT_RECHECK_NS), and neither misses a change. */
    int watch_fd;
    char watch_name[NAME_MAX + 1];
    int waiters; /* threads inside nvmlEventSetWait on it: nvmlEventSetFree refuses while there are any */
};
#define EVSET_MAGIC 0x4e564d4cU

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_dev g_devs[MAX_GPUS];
static struct fake_dev g_migs[MAX_GPUS][MAX_MIG]; /* MIG device handles: index = GPU, pad = slot */
static state_t *g_state;     /* current state, NULL until a file was parsed */
static char *g_state_path;   /* FAKE_NVML_STATE */
static int g_init_count;     /* nvmlInit refcount */
static long long g_last_check_ns = -1;
static long long g_recheck_ns = 50000000LL; /* FAKE_NVML_RECHECK_MS, read at each init */
static struct {
    int valid;
    struct timespec mtim;
    off_t size;
    ino_t ino;
    dev_t dev;
} g_stat;

__attribute__((constructor)) static void fake_nvml_ctor(void)
{
    for (int i = 0; i < MAX_GPUS; i++) {
        g_devs[i].index = i;
        for (int m = 0; m < MAX_MIG; m++) {
            g_migs[i][m].index = i;
            g_migs[i][m].pad = m;
        }
    }
    counts_open();
}

/* ------------------------------------------------------------------------ */
/* Time helpers                                                              */
/* ------------------------------------------------------------------------ */

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void sleep_ns(long long ns)
{
    if (ns <= 0)
        return;
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------------------ */
/* State file parsing                                                        */
/* ------------------------------------------------------------------------ */

static int parse_num(const char *s, long long *out)
{
    char *end;
    if (!s || !*s)
        return -1;
    if (strcasecmp(s, "na") == 0) {
        *out = NA;
        return 0;
    }
    errno = 0;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        *out = (long long)strtoull(s + 2, &end, 16);
    else
        *out = strtoll(s, &end, 10);
    if (*end || errno)
        return -1;
    return 0;
}

static int find_symbol(const char *name)
{
    if (strcmp(name, "*") == 0)
        return -2;
    for (int i = 0; i < NSYM; i++)
        if (strcmp(name, g_sym_names[i]) == 0)
            return i;
    return -1;
}

static field_t *field_slot(gpu_t *g, unsigned int id, unsigned int scope, int create)
{
    for (int i = 0; i < g->nfields; i++)
        if (g->fields[i].id == id && g->fields[i].scope == scope)
            return &g->fields[i];
    if (!create || g->nfields >= MAX_FIELDS)
        return NULL;
    field_t *f = &g->fields[g->nfields++];
    memset(f, 0, sizeof *f);
    f->id = id;
    f->scope = scope;
    return f;
}

/* "<id>" or "<id>:<scope>" of a field line. */
static int parse_field_key(const char *s, unsigned int *id, unsigned int *scope)
{
    char buf[64];
    long long a, b = 0;
    size_t n = strlen(s);
    if (n >= sizeof buf)
        return -1;
    memcpy(buf, s, n + 1);
    char *colon = strchr(buf, ':');
    if (colon) {
        *colon = 0;
        if (parse_num(colon + 1, &b) || b < 0 || b > 0xFFFFFFFFLL)
            return -1;
    }
    if (parse_num(buf, &a) || a < 0 || a > 0xFFFFFFFFLL)
        return -1;
    *id = (unsigned int)a;
    *scope = (unsigned int)b;
    return 0;
}

static int parse_value_type(const char *s)
{
    static const char *const names[] = {"d", "ui", "ul", "ull", "sll", "si", "us"};
    for (int i = 0; i < 7; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    if (s[0] >= '0' && s[0] <= '6' && s[1] == 0)
        return s[0] - '0';
    return -1;
}

static int set_field_value(field_t *f, int type, const char *text)
{
    nvmlValue_t v;
    memset(&v, 0, sizeof v);
    if (type == 0) {
        char *end;
        v.dVal = strtod(text, &end);
        if (*end)
            return -1;
    } else {
        long long n;
        if (parse_num(text, &n) || n == NA)
            return -1;
        switch (type) {
        case 1: v.uiVal = (unsigned int)n; break;
        case 2: v.ulVal = (unsigned long)n; break;
        case 3: v.ullVal = (unsigned long long)n; break;
        case 4: v.sllVal = n; break;
        case 5: v.siVal = (int)n; break;
        case 6: v.usVal = (unsigned short)n; break;
        }
    }
    f->type = (unsigned int)type;
    f->value = v;
    f->has_value = 1;
    return 0;
}

/* Symbol-level error / block / unsupported lines (global or per GPU). */
static int parse_sym_line(const char *key, char **tok, int ntok, int *err, int *err_all,
                          int *block, int *block_all)
{
    long long n = 0;
    int is_unsup = strcmp(key, "unsupported") == 0;
    if (ntok < (is_unsup ? 2 : 3))
        return -1;
    int s = find_symbol(tok[1]);
    if (s == -1)
        return -1;
    if (is_unsup)
        n = NVML_ERROR_NOT_SUPPORTED;
    else if (parse_num(tok[2], &n) || n == NA)
        return -1;
    if (strcmp(key, "block") == 0) {
        if (s == -2)
            *block_all = (int)n;
        else
            block[s] = (int)n;
    } else {
        if (s == -2)
            *err_all = (int)n;
        else
            err[s] = (int)n;
    }
    return 0;
}

static void copy_rest(char *dst, size_t cap, const char *rest)
{
    size_t n = strlen(rest);
    while (n && isspace((unsigned char)rest[n - 1]))
        n--;
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, rest, n);
    dst[n] = 0;
}

static int parse_gpu_line(state_t *st, gpu_t *g, const char *key, char **tok, int ntok,
                          const char *rest)
{
    long long a, b, c, d;
    for (int k = 0; k < NKEYS; k++) {
        if (strcmp(key, g_keys[k].name) != 0)
            continue;
        if (ntok - 1 < g_keys[k].nvals)
            return -1;
        for (int i = 0; i < g_keys[k].nvals; i++)
            if (parse_num(tok[1 + i], &g->v[k][i]))
                return -1;
        g->present |= 1ULL << k;
        return 0;
    }
    for (int s = 0; s < NSTR; s++) {
        if (strcmp(key, g_str_keys[s]) != 0)
            continue;
        copy_rest(g->str[s], STR_LEN, rest);
        g->str_present |= 1U << s;
        if (s == S_PCI_BUS_ID) {
            unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
            if (sscanf(g->str[s], "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
                return -1;
            g->pci_domain = dom;
            g->pci_bus = bus;
            g->pci_dev = dev;
        }
        return 0;
    }
    if (strcmp(key, "threshold") == 0 || strcmp(key, "clock") == 0 || strcmp(key, "max_clock") == 0) {
        if (ntok < 3 || parse_num(tok[1], &a) || parse_num(tok[2], &b))
            return -1;
        if (key[0] == 't') {
            if (a < 0 || a > 7)
                return -1;
            g->threshold[a] = b;
            g->threshold_has |= 1U << a;
        } else {
            if (a < 0 || a > 3)
                return -1;
            if (key[0] == 'c') {
                g->clock[a] = b;
                g->clock_has |= 1U << a;
            } else {
                g->max_clock[a] = b;
                g->max_clock_has |= 1U << a;
            }
        }
        return 0;
    }
    if (strcmp(key, "fan") == 0) {
        if (ntok < 5 || parse_num(tok[1], &a) || parse_num(tok[2], &b) || parse_num(tok[3], &c) ||
            parse_num(tok[4], &d) || a < 0 || a >= MAX_FANS)
            return -1;
        g->fan_speed[a] = b;
        g->fan_target[a] = c;
        g->fan_rpm[a] = d;
        if (a + 1 > g->num_fans)
            g->num_fans = (int)a + 1;
        return 0;
    }
    if (strcmp(key, "ecc_errors") == 0) {
        if (ntok < 4 || parse_num(tok[1], &a) || parse_num(tok[2], &b) || parse_num(tok[3], &c) ||
            a < 0 || a > 1 || b < 0 || b > 1)
            return -1;
        g->ecc[a][b] = c;
        g->ecc_has |= 1U << (a * 2 + b);
        return 0;
    }
    if (strcmp(key, "field") == 0) {
        int type;
        unsigned int id, scope;
        if (ntok < 4 || parse_field_key(tok[1], &id, &scope) || (type = parse_value_type(tok[2])) < 0)
            return -1;
        field_t *f = field_slot(g, id, scope, 1);
        return f ? set_field_value(f, type, tok[3]) : -1;
    }
    if (strcmp(key, "gpm") == 0) {
        char *end;
        if (ntok < 3 || parse_num(tok[1], &a) || a < 0 || g->ngpm >= MAX_GPM)
            return -1;
        double value = strtod(tok[2], &end);
        if (*end)
            return -1;
        g->gpm_id[g->ngpm] = (unsigned int)a;
        g->gpm_value[g->ngpm++] = value;
        return 0;
    }
    if (strcmp(key, "mig") == 0) { /* mig <slot> <gi> <ci> <total> <used> <uuid> <name to end of line> */
        long long e, f;
        if (ntok < 8 || parse_num(tok[1], &a) || a < 0 || a >= MAX_MIG || parse_num(tok[2], &b) ||
            parse_num(tok[3], &c) || parse_num(tok[4], &e) || parse_num(tok[5], &f) || strlen(tok[6]) >= STR_LEN)
            return -1;
        mig_t *m = &g->mig[a];
        memset(m, 0, sizeof *m);
        m->present = 1;
        m->gi = (unsigned int)b;
        m->ci = (unsigned int)c;
        m->total = e;
        m->used = f;
        strcpy(m->uuid, tok[6]);
        const char *name = rest;
        for (int skip = 0; skip < 6 && name; skip++) { /* past the six numbers and the uuid */
            name = strchr(name, ' ');
            while (name && *name == ' ')
                name++;
        }
        copy_rest(m->name, STR_LEN, name ? name : "");
        return 0;
    }
    if (strcmp(key, "mig_gpm") == 0) { /* mig_gpm <slot> <metricId> <value> */
        char *end;
        if (ntok < 4 || parse_num(tok[1], &a) || a < 0 || a >= MAX_MIG || parse_num(tok[2], &b))
            return -1;
        mig_t *m = &g->mig[a];
        if (m->ngpm >= MAX_MIG_GPM)
            return -1;
        double value = strtod(tok[3], &end);
        if (*end)
            return -1;
        m->gpm_id[m->ngpm] = (unsigned int)b;
        m->gpm_value[m->ngpm++] = value;
        return 0;
    }
    if (strcmp(key, "nvlink_remote") == 0) {
        if (ntok < 4 || parse_num(tok[1], &a) || parse_num(tok[2], &b) || a < 0 || a >= MAX_LINKS ||
            strlen(tok[3]) >= sizeof g->nvl_remote_bus[0])
            return -1;
        g->nvl_remote_type[a] = (unsigned int)b;
        strcpy(g->nvl_remote_bus[a], tok[3]);
        g->nvl_remote_has |= 1ULL << a;
        return 0;
    }
    if (strcmp(key, "field_error") == 0 || strcmp(key, "field_min_batch") == 0) {
        /* field_error <id> <code> | field_min_batch <id> <n>: a number kept on the field's slot */
        unsigned int id, scope;
        int least = key[6] == 'm';
        if (ntok < 3 || parse_field_key(tok[1], &id, &scope) || parse_num(tok[2], &b) || (least && b < 0))
            return -1;
        field_t *f = field_slot(g, id, scope, 1);
        if (!f)
            return -1;
        if (least)
            f->min_batch = (int)b;
        else
            f->err = (int)b;
        return 0;
    }
    if (strcmp(key, "error") == 0 || strcmp(key, "unsupported") == 0 || strcmp(key, "block") == 0)
        return parse_sym_line(key, tok, ntok, g->err, &g->err_all, g->block_ms, &g->block_all);
    if (strcmp(key, "process") == 0) {
        int kind;
        if (ntok < 4)
            return -1;
        if (strcmp(tok[1], "compute") == 0)
            kind = 0;
        else if (strcmp(tok[1], "graphics") == 0)
            kind = 1;
        else
            return -1;
        if (parse_num(tok[2], &a) || parse_num(tok[3], &b) || g->nproc[kind] >= MAX_PROCS)
            return -1;
        proc_t *p = &g->procs[kind][g->nproc[kind]++];
        p->pid = (unsigned int)a;
        p->used = b == NA ? NOT_AVAILABLE_ULL : (unsigned long long)b;
        p->gi = p->ci = NO_INSTANCE;
        if (ntok >= 6) { /* process <kind> <pid> <bytes> <gi> <ci>: on a MIG instance */
            if (parse_num(tok[4], &c) || parse_num(tok[5], &d))
                return -1;
            p->gi = (unsigned int)c;
            p->ci = (unsigned int)d;
        }
        return 0;
    }
    if (strcmp(key, "xid") == 0) {
        if (ntok < 3 || parse_num(tok[1], &a) || parse_num(tok[2], &b) || st->nxid >= MAX_XIDS)
            return -1;
        xid_t *x = &st->xids[st->nxid++];
        x->gpu = (int)(g - st->gpus);
        x->seq = a;
        x->xid = (unsigned long long)b;
        x->type = XID_EVENT;
        return 0;
    }
    if (strcmp(key, "event") == 0) { /* event <seq> <type> <data>: any other event type, e.g. 0x100 MIG config */
        if (ntok < 4 || parse_num(tok[1], &a) || parse_num(tok[2], &b) || parse_num(tok[3], &c) ||
            st->nxid >= MAX_XIDS)
            return -1;
        xid_t *x = &st->xids[st->nxid++];
        x->gpu = (int)(g - st->gpus);
        x->seq = a;
        x->type = (unsigned long long)b;
        x->xid = (unsigned long long)c;
        return 0;
    }
    return -2;
}

static int parse_global_line(state_t *st, const char *key, char **tok, int ntok, const char *rest)
{
    long long a;
    if (strcmp(key, "driver_version") == 0) {
        copy_rest(st->driver_version, sizeof st->driver_version, rest);
        return 0;
    }
    if (strcmp(key, "nvml_version") == 0) {
        copy_rest(st->nvml_version, sizeof st->nvml_version, rest);
        return 0;
    }
    if (strcmp(key, "error") == 0 || strcmp(key, "unsupported") == 0 || strcmp(key, "block") == 0)
        return parse_sym_line(key, tok, ntok, st->err, &st->err_all, st->block_ms, &st->block_all);
    if (ntok < 2 || parse_num(tok[1], &a) || a == NA)
        return -2;
    if (strcmp(key, "init_error") == 0)
        st->init_error = (int)a;
    else if (strcmp(key, "cuda_version") == 0)
        st->cuda_version = a;
    else if (strcmp(key, "cuda_version_v2") == 0)
        st->cuda_version_v2 = a;
    else if (strcmp(key, "gpu_count") == 0) {
        if (a < 0 || a > MAX_GPUS)
            return -1;
        st->gpu_count = (int)a;
    } else if (strcmp(key, "fieldvalues_all_failed") == 0)
        st->fv_all_failed = (int)a;
    else if (strcmp(key, "xid_after_register") == 0)
        st->xid_after_register = (int)a;
    else
        return -2;
    return 0;
}

/* A state lives in its own anonymous mapping: its pages are zero until written, and only the GPUs,
 * fields and XIDs a file names are (a state_t is ~2.9 MB for 64 GPUs: malloc + memset made all of it
 * resident in every process over this library, the exporter measured by bench/ included). */
static state_t *state_alloc(void)
{
    void *p = mmap(NULL, sizeof(state_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void state_free(state_t *st)
{
    if (st)
        munmap(st, sizeof(state_t));
}

/* st: from state_alloc (all zero) */
static int parse_state_file(const char *path, state_t *st)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    strcpy(st->driver_version, "590.48.01");
    strcpy(st->nvml_version, "13.590.48.01");
    st->cuda_version = 13010;
    st->cuda_version_v2 = -1;
    st->gpu_count = -1;
    st->fv_all_failed = -1;

    gpu_t *cur = NULL;
    int max_index = -1;
    char line[2048];
    int lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *p = line;
        while (isspace((unsigned char)*p))
            p++;
        if (!*p || *p == '#')
            continue;
        /* tokenize a copy; keep the original for string values */
        char copy[sizeof line];
        strcpy(copy, p);
        char *tok[12];
        int ntok = 0;
        char *save = NULL;
        for (char *t = strtok_r(copy, " \t\r\n", &save); t && ntok < 12; t = strtok_r(NULL, " \t\r\n", &save))
            tok[ntok++] = t;
        const char *rest = p + strlen(tok[0]);
        while (isspace((unsigned char)*rest))
            rest++;
        int rc;
        if (strcmp(tok[0], "gpu") == 0) {
            long long idx;
            if (ntok < 2 || parse_num(tok[1], &idx) || idx < 0 || idx >= MAX_GPUS) {
                rc = -1;
            } else {
                cur = &st->gpus[idx];
                if (idx > max_index)
                    max_index = (int)idx;
                rc = 0;
            }
        } else if (strcmp(tok[0], "global") == 0) {
            cur = NULL;
            rc = 0;
        } else if (cur) {
            rc = parse_gpu_line(st, cur, tok[0], tok, ntok, rest);
        } else {
            rc = parse_global_line(st, tok[0], tok, ntok, rest);
        }
        if (rc == -2)
            fprintf(stderr, "fake_nvml: %s:%d: unknown key '%s' ignored\n", path, lineno, tok[0]);
        else if (rc)
            fprintf(stderr, "fake_nvml: %s:%d: bad line ignored: %s", path, lineno, p);
    }
    fclose(f);
    if (st->gpu_count < 0)
        st->gpu_count = max_index + 1;
    if (st->cuda_version_v2 < 0)
        st->cuda_version_v2 = st->cuda_version;
    return 0;
}

/* Caller holds g_mu. force: ignore the 50 ms throttle (nvmlInitWithFlags). */
static void maybe_reload(int force)
{
    long long now = mono_ns();
    if (!force && g_last_check_ns >= 0 && now - g_last_check_ns < g_recheck_ns)
        return;
    g_last_check_ns = now;
    if (!g_state_path)
        return;
    struct stat sb;
    if (stat(g_state_path, &sb) != 0)
        return;
    if (g_stat.valid && g_state && sb.st_mtim.tv_sec == g_stat.mtim.tv_sec &&
        sb.st_mtim.tv_nsec == g_stat.mtim.tv_nsec && sb.st_size == g_stat.size &&
        sb.st_ino == g_stat.ino && sb.st_dev == g_stat.dev)
        return;
    state_t *ns = state_alloc();
    if (!ns)
        return;
    if (parse_state_file(g_state_path, ns) != 0) {
        state_free(ns);
        return;
    }
    state_free(g_state);
    g_state = ns;
    g_stat.valid = 1;
    g_stat.mtim = sb.st_mtim;
    g_stat.size = sb.st_size;
    g_stat.ino = sb.st_ino;
    g_stat.dev = sb.st_dev;
}

/* ------------------------------------------------------------------------ */
/* Call prologue / epilogue                                                  */
/* ------------------------------------------------------------------------ */

static int block_for(int sym, int gi)
{
    state_t *st = g_state;
    if (!st)
        return 0;
    if (gi >= 0 && gi < MAX_GPUS) {
        gpu_t *g = &st->gpus[gi];
        if (g->block_ms[sym])
            return g->block_ms[sym];
        if (g->block_all)
            return g->block_all;
    }
    if (st->block_ms[sym])
        return st->block_ms[sym];
    return st->block_all;
}

/* Caller holds g_mu; it is released while sleeping and held again on return. */
static void wait_block(int sym, int gi)
{
    int ms = block_for(sym, gi);
    if (!ms)
        return;
    long long start = mono_ns();
    for (;;) {
        long long slice = 10000000LL; /* 10 ms: re-check the state while blocked */
        if (ms > 0) {
            long long left = (long long)ms * 1000000LL - (mono_ns() - start);
            if (left <= 0)
                return;
            if (left < slice)
                slice = left;
        }
        pthread_mutex_unlock(&g_mu);
        sleep_ns(slice);
        pthread_mutex_lock(&g_mu);
        maybe_reload(0);
        ms = block_for(sym, gi);
        if (!ms)
            return;
    }
}

static int wildcard_ok(int sym)
{
    return sym != SYM_nvmlInitWithFlags && sym != SYM_nvmlInit_v2 && sym != SYM_nvmlShutdown &&
           sym != SYM_nvmlErrorString;
}

static int injected_error(int sym, int gi)
{
    state_t *st = g_state;
    if (gi >= 0) {
        gpu_t *g = &st->gpus[gi];
        if ((g->present >> K_lost & 1) && g->v[K_lost][0])
            return NVML_ERROR_GPU_IS_LOST;
        if (g->err[sym])
            return g->err[sym];
        if (g->err_all && wildcard_ok(sym))
            return g->err_all;
    }
    if (st->err[sym])
        return st->err[sym];
    if (st->err_all && wildcard_ok(sym))
        return st->err_all;
    return NVML_SUCCESS;
}

static int dev_index(nvmlDevice_t d)
{
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)g_devs;
    if (p < base || p >= base + sizeof g_devs || (p - base) % sizeof(struct fake_dev))
        return -1;
    return (int)((p - base) / sizeof(struct fake_dev));
}

static nvmlReturn_t unlock_ret(nvmlReturn_t r)
{
    pthread_mutex_unlock(&g_mu);
    count_cpu();
    return r;
}

/* Per-GPU prologue for a call addressed by GPU index gi (-1 = bad handle).
 * On NVML_SUCCESS the mutex is held and *out points at the GPU. */
static nvmlReturn_t gpu_begin(int sym, int gi, gpu_t **out)
{
    pthread_mutex_lock(&g_mu);
    maybe_reload(0);
    if (gi >= 0)
        wait_block(sym, gi);
    if (g_init_count <= 0 || !g_state)
        return unlock_ret(NVML_ERROR_UNINITIALIZED);
    if (gi < 0 || gi >= g_state->gpu_count)
        return unlock_ret(NVML_ERROR_INVALID_ARGUMENT);
    int r = injected_error(sym, gi);
    if (r)
        return unlock_ret(r);
    *out = &g_state->gpus[gi];
    return NVML_SUCCESS;
}

static nvmlReturn_t dev_begin(int sym, nvmlDevice_t dev, gpu_t **out)
{
    count_call(sym);
    return gpu_begin(sym, dev_index(dev), out);
}

/* A MIG device handle: *gpu and *slot, or 0 for anything else. */
static int mig_handle(nvmlDevice_t d, int *gpu, int *slot)
{
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)g_migs;
    if (p < base || p >= base + sizeof g_migs || (p - base) % sizeof(struct fake_dev))
        return 0;
    size_t i = (p - base) / sizeof(struct fake_dev);
    *gpu = (int)(i / MAX_MIG);
    *slot = (int)(i % MAX_MIG);
    return 1;
}

/* Per-MIG-device prologue: the parent's checks, then the instance must exist (else INVALID_ARGUMENT:
 * a handle of a destroyed instance). On NVML_SUCCESS the mutex is held. */
static nvmlReturn_t mig_begin(int sym, nvmlDevice_t dev, gpu_t **g, mig_t **m)
{
    int gi, slot;
    count_call(sym);
    if (!mig_handle(dev, &gi, &slot))
        return gpu_begin(sym, -1, g);
    nvmlReturn_t r = gpu_begin(sym, gi, g);
    if (r)
        return r;
    *m = &(*g)->mig[slot];
    if (!(*m)->present)
        return unlock_ret(NVML_ERROR_INVALID_ARGUMENT);
    return NVML_SUCCESS;
}

/* System-level prologue. On NVML_SUCCESS the mutex is held. */
static nvmlReturn_t sys_begin(int sym)
{
    count_call(sym);
    pthread_mutex_lock(&g_mu);
    maybe_reload(0);
    wait_block(sym, -1);
    if (g_init_count <= 0 || !g_state)
        return unlock_ret(NVML_ERROR_UNINITIALIZED);
    int r = injected_error(sym, -1);
    if (r)
        return unlock_ret(r);
    return NVML_SUCCESS;
}

#define HAS(g, key) (((g)->present >> (K_##key)) & 1ULL)
#define VAL(g, key, i) ((g)->v[K_##key][i])

#define BEGIN_DEV(name, dev)                                                   \
    gpu_t *g;                                                                  \
    {                                                                          \
        nvmlReturn_t r0_ = dev_begin(SYM_##name, (dev), &g);                   \
        if (r0_ != NVML_SUCCESS)                                               \
            return r0_;                                                        \
    }
#define END(r) return unlock_ret(r)
#define NEED(p)                                                                \
    if (!(p))                                                                  \
    END(NVML_ERROR_INVALID_ARGUMENT)
#define REQUIRE(g, key)                                                        \
    if (!HAS(g, key) || VAL(g, key, 0) == NA)                                  \
    END(NVML_ERROR_NOT_SUPPORTED)

/* unsigned int getter for scalar key value index i */
#define UINT_GETTER(name, key, i)                                              \
    nvmlReturn_t name(nvmlDevice_t dev, unsigned int *out)                     \
    {                                                                          \
        BEGIN_DEV(name, dev);                                                  \
        NEED(out);                                                             \
        REQUIRE(g, key);                                                       \
        *out = (unsigned int)VAL(g, key, i);                                   \
        END(NVML_SUCCESS);                                                     \
    }
#define ULL_GETTER(name, key, i)                                               \
    nvmlReturn_t name(nvmlDevice_t dev, unsigned long long *out)               \
    {                                                                          \
        BEGIN_DEV(name, dev);                                                  \
        NEED(out);                                                             \
        REQUIRE(g, key);                                                       \
        *out = (unsigned long long)VAL(g, key, i);                             \
        END(NVML_SUCCESS);                                                     \
    }

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int length)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* UUID and name of a MIG device; other strings are the parent's only. */
static nvmlReturn_t mig_string(int sym, nvmlDevice_t dev, int skey, char *buf, unsigned int length)
{
    gpu_t *g;
    mig_t *m;
    nvmlReturn_t r = mig_begin(sym, dev, &g, &m);
    if (r)
        return r;
    if (skey == S_UUID)
        END(copy_string(m->uuid, buf, length));
    if (skey == S_NAME)
        END(copy_string(m->name, buf, length));
    END(NVML_ERROR_NOT_SUPPORTED);
}

#define STRING_GETTER(name, skey)                                              \
    nvmlReturn_t name(nvmlDevice_t dev, char *buf, unsigned int length)        \
    {                                                                          \
        int mg_, ms_;                                                          \
        if (mig_handle(dev, &mg_, &ms_))                                       \
            return mig_string(SYM_##name, dev, skey, buf, length);             \
        BEGIN_DEV(name, dev);                                                  \
        if (!(g->str_present >> (skey) & 1U))                                  \
            END(NVML_ERROR_NOT_SUPPORTED);                                     \
        END(copy_string(g->str[skey], buf, length));                           \
    }

/* ------------------------------------------------------------------------ */
/* Init / system                                                             */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t do_init(int sym)
{
    count_call(sym);
    pthread_mutex_lock(&g_mu);
    const char *recheck = getenv("FAKE_NVML_RECHECK_MS");
    g_recheck_ns = (recheck && *recheck) ? atoll(recheck) * 1000000LL : 50000000LL;
    const char *p = getenv("FAKE_NVML_STATE");
    if (p && *p && (!g_state_path || strcmp(p, g_state_path) != 0)) {
        free(g_state_path);
        g_state_path = strdup(p);
        g_stat.valid = 0;
    }
    maybe_reload(1);
    wait_block(sym, -1);
    if (!g_state) {
        static int warned;
        if (!warned++)
            fprintf(stderr, "fake_nvml: no usable state file (FAKE_NVML_STATE=%s)\n",
                    g_state_path ? g_state_path : "(unset)");
        return unlock_ret(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    if (g_state->init_error)
        return unlock_ret(g_state->init_error);
    if (g_state->err[sym])
        return unlock_ret(g_state->err[sym]);
    g_init_count++;
    return unlock_ret(NVML_SUCCESS);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return do_init(SYM_nvmlInitWithFlags);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return do_init(SYM_nvmlInit_v2);
}

nvmlReturn_t nvmlShutdown(void)
{
    count_call(SYM_nvmlShutdown);
    pthread_mutex_lock(&g_mu);
    maybe_reload(0);
    wait_block(SYM_nvmlShutdown, -1);
    if (g_init_count <= 0)
        return unlock_ret(NVML_ERROR_UNINITIALIZED);
    if (g_state && g_state->err[SYM_nvmlShutdown])
        return unlock_ret(g_state->err[SYM_nvmlShutdown]);
    g_init_count--;
    return unlock_ret(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    static const char *const names[] = {
        [0] = "Success",
        [1] = "Uninitialized",
        [2] = "Invalid Argument",
        [3] = "Not Supported",
        [4] = "Insufficient Permissions",
        [5] = "Already Initialized",
        [6] = "Not Found",
        [7] = "Insufficient Size",
        [8] = "Insufficient External Power",
        [9] = "Driver Not Loaded",
        [10] = "Timeout",
        [11] = "Interrupt Request Issue",
        [12] = "NVML Shared Library Not Found",
        [13] = "Function Not Found",
        [14] = "Corrupted infoROM",
        [15] = "GPU is lost",
        [16] = "GPU requires restart",
        [17] = "The operating system has blocked the request.",
        [18] = "RM has detected an NVML/RM version mismatch.",
        [19] = "In use by another client",
        [20] = "Insufficient Memory",
        [21] = "No data",
        [22] = "The requested vgpu operation is not available on target device, because ECC is enabled",
        [23] = "Insufficient resources",
        [24] = "Frequency not supported",
        [25] = "Argument version mismatch",
        [26] = "Requested functionality has been deprecated",
        [27] = "System is not ready for the request",
        [28] = "GPU not found",
        [29] = "Invalid state",
        [30] = "Reset type not supported",
    };
    count_call(SYM_nvmlErrorString);
    if (result >= 0 && result < (int)(sizeof names / sizeof names[0]) && names[result])
        return names[result];
    return "Unknown Error";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlSystemGetDriverVersion);
    if (r)
        return r;
    END(copy_string(g_state->driver_version, version, length));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlSystemGetNVMLVersion);
    if (r)
        return r;
    END(copy_string(g_state->nvml_version, version, length));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlSystemGetCudaDriverVersion);
    if (r)
        return r;
    NEED(v);
    *v = (int)g_state->cuda_version;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlSystemGetCudaDriverVersion_v2);
    if (r)
        return r;
    NEED(v);
    *v = (int)g_state->cuda_version_v2;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlDeviceGetCount_v2);
    if (r)
        return r;
    NEED(count);
    *count = (unsigned int)g_state->gpu_count;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    gpu_t *g;
    count_call(SYM_nvmlDeviceGetHandleByIndex_v2);
    nvmlReturn_t r = gpu_begin(SYM_nvmlDeviceGetHandleByIndex_v2, index < MAX_GPUS ? (int)index : -1, &g);
    if (r)
        return r;
    NEED(device);
    *device = &g_devs[index];
    END(NVML_SUCCESS);
}

/* Lookup by a predicate, then run the per-GPU checks for the match. */
static nvmlReturn_t handle_lookup(int sym, int (*match)(const gpu_t *, const void *), const void *arg,
                                  nvmlDevice_t *device)
{
    count_call(sym);
    pthread_mutex_lock(&g_mu);
    maybe_reload(0);
    wait_block(sym, -1);
    if (g_init_count <= 0 || !g_state)
        return unlock_ret(NVML_ERROR_UNINITIALIZED);
    if (!arg || !device)
        return unlock_ret(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_state->gpu_count; i++) {
        if (!match(&g_state->gpus[i], arg))
            continue;
        int e = injected_error(sym, i);
        if (e)
            return unlock_ret(e);
        *device = &g_devs[i];
        return unlock_ret(NVML_SUCCESS);
    }
    int e = injected_error(sym, -1);
    return unlock_ret(e ? e : NVML_ERROR_NOT_FOUND);
}

static int match_uuid(const gpu_t *g, const void *arg)
{
    return (g->str_present >> S_UUID & 1U) && strcmp(g->str[S_UUID], (const char *)arg) == 0;
}

static int match_pci(const gpu_t *g, const void *arg)
{
    unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
    if (!(g->str_present >> S_PCI_BUS_ID & 1U))
        return 0;
    if (sscanf((const char *)arg, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
        return 0;
    return dom == g->pci_domain && bus == g->pci_bus && dev == g->pci_dev && fn == 0;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    return handle_lookup(SYM_nvmlDeviceGetHandleByUUID, match_uuid, uuid, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *busId, nvmlDevice_t *device)
{
    return handle_lookup(SYM_nvmlDeviceGetHandleByPciBusId_v2, match_pci, busId, device);
}

/* ------------------------------------------------------------------------ */
/* Identity                                                                  */
/* ------------------------------------------------------------------------ */

STRING_GETTER(nvmlDeviceGetUUID, S_UUID)
STRING_GETTER(nvmlDeviceGetName, S_NAME)
STRING_GETTER(nvmlDeviceGetSerial, S_SERIAL)
STRING_GETTER(nvmlDeviceGetVbiosVersion, S_VBIOS)
UINT_GETTER(nvmlDeviceGetMinorNumber, minor, 0)
UINT_GETTER(nvmlDeviceGetArchitecture, architecture, 0)
UINT_GETTER(nvmlDeviceGetBrand, brand, 0)
UINT_GETTER(nvmlDeviceGetPersistenceMode, persistence, 0)

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index)
{
    BEGIN_DEV(nvmlDeviceGetIndex, dev);
    NEED(index);
    *index = (unsigned int)(g - g_state->gpus);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    BEGIN_DEV(nvmlDeviceGetPciInfo_v3, dev);
    NEED(pci);
    if (!(g->str_present >> S_PCI_BUS_ID & 1U))
        END(NVML_ERROR_NOT_SUPPORTED);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", g->pci_domain & 0xFFFFU,
             g->pci_bus & 0xFFU, g->pci_dev & 0xFFU);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", g->pci_domain, g->pci_bus & 0xFFU,
             g->pci_dev & 0xFFU);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_dev;
    pci->pciDeviceId = HAS(g, pci_device_id) ? (unsigned int)VAL(g, pci_device_id, 0) : 0;
    pci->pciSubSystemId = HAS(g, pci_subsystem_id) ? (unsigned int)VAL(g, pci_subsystem_id, 0) : 0;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t dev, int *major, int *minor)
{
    BEGIN_DEV(nvmlDeviceGetCudaComputeCapability, dev);
    NEED(major && minor);
    REQUIRE(g, cuda_cc);
    *major = (int)VAL(g, cuda_cc, 0);
    *minor = (int)VAL(g, cuda_cc, 1);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Temperatures                                                              */
/* ------------------------------------------------------------------------ */

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t dev, nvmlTemperature_v1_t *temp)
{
    BEGIN_DEV(nvmlDeviceGetTemperatureV, dev);
    NEED(temp);
    if (temp->version != nvmlTemperature_v1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    NEED(temp->sensorType == 0);
    REQUIRE(g, temperature);
    temp->temperature = (int)VAL(g, temperature, 0);
    END(NVML_SUCCESS);
}
#endif

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, unsigned int sensor, unsigned int *temp)
{
    BEGIN_DEV(nvmlDeviceGetTemperature, dev);
    NEED(temp && sensor == 0);
    REQUIRE(g, temperature);
    *temp = (unsigned int)VAL(g, temperature, 0);
    END(NVML_SUCCESS);
}

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetMarginTemperature(nvmlDevice_t dev, nvmlMarginTemperature_v1_t *info)
{
    BEGIN_DEV(nvmlDeviceGetMarginTemperature, dev);
    NEED(info);
    if (info->version != nvmlMarginTemperature_v1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(g, margin_temperature);
    info->marginTemperature = (int)VAL(g, margin_temperature, 0);
    END(NVML_SUCCESS);
}
#endif

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t dev, unsigned int type, unsigned int *temp)
{
    BEGIN_DEV(nvmlDeviceGetTemperatureThreshold, dev);
    NEED(temp && type < 8);
    if (!(g->threshold_has >> type & 1U) || g->threshold[type] == NA)
        END(NVML_ERROR_NOT_SUPPORTED);
    *temp = (unsigned int)g->threshold[type];
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Fans                                                                      */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetNumFans(nvmlDevice_t dev, unsigned int *n)
{
    BEGIN_DEV(nvmlDeviceGetNumFans, dev);
    NEED(n);
    if (g->num_fans <= 0)
        END(NVML_ERROR_NOT_SUPPORTED);
    *n = (unsigned int)g->num_fans;
    END(NVML_SUCCESS);
}

/* which: 0 speed %, 1 target %, 2 rpm */
static nvmlReturn_t fan_value(gpu_t *g, unsigned int fan, int which, unsigned int *out)
{
    if (g->num_fans <= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (!out || fan >= (unsigned int)g->num_fans)
        return NVML_ERROR_INVALID_ARGUMENT;
    long long v = which == 0 ? g->fan_speed[fan] : which == 1 ? g->fan_target[fan] : g->fan_rpm[fan];
    if (v == NA)
        return NVML_ERROR_NOT_SUPPORTED;
    *out = (unsigned int)v;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t dev, unsigned int *speed)
{
    BEGIN_DEV(nvmlDeviceGetFanSpeed, dev);
    END(fan_value(g, 0, 0, speed));
}

nvmlReturn_t nvmlDeviceGetFanSpeed_v2(nvmlDevice_t dev, unsigned int fan, unsigned int *speed)
{
    BEGIN_DEV(nvmlDeviceGetFanSpeed_v2, dev);
    END(fan_value(g, fan, 0, speed));
}

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetTargetFanSpeed(nvmlDevice_t dev, unsigned int fan, unsigned int *target)
{
    BEGIN_DEV(nvmlDeviceGetTargetFanSpeed, dev);
    END(fan_value(g, fan, 1, target));
}

nvmlReturn_t nvmlDeviceGetFanSpeedRPM(nvmlDevice_t dev, nvmlFanSpeedInfo_v1_t *info)
{
    BEGIN_DEV(nvmlDeviceGetFanSpeedRPM, dev);
    NEED(info);
    if (info->version != nvmlFanSpeedInfo_v1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    END(fan_value(g, info->fan, 2, &info->speed));
}
#endif

/* ------------------------------------------------------------------------ */
/* Power                                                                     */
/* ------------------------------------------------------------------------ */

UINT_GETTER(nvmlDeviceGetPowerUsage, power_usage, 0)
ULL_GETTER(nvmlDeviceGetTotalEnergyConsumption, total_energy, 0)
UINT_GETTER(nvmlDeviceGetEnforcedPowerLimit, enforced_power_limit, 0)
UINT_GETTER(nvmlDeviceGetPowerManagementLimit, power_limit, 0)
UINT_GETTER(nvmlDeviceGetPowerManagementDefaultLimit, default_power_limit, 0)
UINT_GETTER(nvmlDeviceGetPerformanceState, pstate, 0)

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t dev, unsigned int *minLimit,
                                                          unsigned int *maxLimit)
{
    BEGIN_DEV(nvmlDeviceGetPowerManagementLimitConstraints, dev);
    NEED(minLimit && maxLimit);
    REQUIRE(g, power_limit_constraints);
    *minLimit = (unsigned int)VAL(g, power_limit_constraints, 0);
    *maxLimit = (unsigned int)VAL(g, power_limit_constraints, 1);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Utilization / memory                                                      */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *u)
{
    BEGIN_DEV(nvmlDeviceGetUtilizationRates, dev);
    NEED(u);
    REQUIRE(g, utilization);
    u->gpu = (unsigned int)VAL(g, utilization, 0);
    u->memory = (unsigned int)VAL(g, utilization, 1);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    BEGIN_DEV(nvmlDeviceGetEncoderUtilization, dev);
    NEED(util && period);
    REQUIRE(g, encoder_utilization);
    *util = (unsigned int)VAL(g, encoder_utilization, 0);
    *period = (unsigned int)VAL(g, encoder_utilization, 1);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t dev, unsigned int *util, unsigned int *period)
{
    BEGIN_DEV(nvmlDeviceGetDecoderUtilization, dev);
    NEED(util && period);
    REQUIRE(g, decoder_utilization);
    *util = (unsigned int)VAL(g, decoder_utilization, 0);
    *period = (unsigned int)VAL(g, decoder_utilization, 1);
    END(NVML_SUCCESS);
}

static void memory_values(const gpu_t *g, unsigned long long *total, unsigned long long *reserved,
                          unsigned long long *used, unsigned long long *free_)
{
    *total = (unsigned long long)g->v[K_memory][0];
    *reserved = (unsigned long long)g->v[K_memory][1];
    *used = (unsigned long long)g->v[K_memory][2];
    *free_ = *total > *reserved + *used ? *total - *reserved - *used : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
    int mg_, ms_;
    if (mig_handle(dev, &mg_, &ms_)) { /* a MIG instance's own frame buffer */
        gpu_t *g;
        mig_t *m;
        nvmlReturn_t r = mig_begin(SYM_nvmlDeviceGetMemoryInfo, dev, &g, &m);
        if (r)
            return r;
        NEED(mem);
        mem->total = (unsigned long long)m->total;
        mem->used = (unsigned long long)m->used;
        mem->free = (unsigned long long)(m->total - m->used);
        END(NVML_SUCCESS);
    }
    BEGIN_DEV(nvmlDeviceGetMemoryInfo, dev);
    NEED(mem);
    REQUIRE(g, memory);
    unsigned long long total, reserved, used, free_;
    memory_values(g, &total, &reserved, &used, &free_);
    mem->total = total;
    mem->used = used + reserved; /* v1: used includes driver-reserved memory */
    mem->free = free_;
    END(NVML_SUCCESS);
}

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
    BEGIN_DEV(nvmlDeviceGetMemoryInfo_v2, dev);
    NEED(mem);
    if (mem->version != nvmlMemory_v2)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(g, memory);
    memory_values(g, &mem->total, &mem->reserved, &mem->used, &mem->free);
    END(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* Clocks                                                                    */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t dev, unsigned int type, unsigned int *clock)
{
    BEGIN_DEV(nvmlDeviceGetClockInfo, dev);
    NEED(clock && type < 4);
    if (!(g->clock_has >> type & 1U) || g->clock[type] == NA)
        END(NVML_ERROR_NOT_SUPPORTED);
    *clock = (unsigned int)g->clock[type];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t dev, unsigned int type, unsigned int *clock)
{
    BEGIN_DEV(nvmlDeviceGetMaxClockInfo, dev);
    NEED(clock && type < 4);
    if (!(g->max_clock_has >> type & 1U) || g->max_clock[type] == NA)
        END(NVML_ERROR_NOT_SUPPORTED);
    *clock = (unsigned int)g->max_clock[type];
    END(NVML_SUCCESS);
}

#if NEW_SYMBOL
ULL_GETTER(nvmlDeviceGetCurrentClocksEventReasons, clocks_event_reasons, 0)
ULL_GETTER(nvmlDeviceGetSupportedClocksEventReasons, supported_clocks_event_reasons, 0)
#endif
ULL_GETTER(nvmlDeviceGetCurrentClocksThrottleReasons, clocks_event_reasons, 0)
ULL_GETTER(nvmlDeviceGetSupportedClocksThrottleReasons, supported_clocks_event_reasons, 0)

/* ------------------------------------------------------------------------ */
/* PCIe                                                                      */
/* ------------------------------------------------------------------------ */

UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen, 0)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width, 0)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_max_gen, 0)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_max_width, 0)
UINT_GETTER(nvmlDeviceGetPcieReplayCounter, pcie_replay, 0)

/* ------------------------------------------------------------------------ */
/* Health                                                                    */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    BEGIN_DEV(nvmlDeviceGetRemappedRows, dev);
    NEED(corrRows && uncRows && isPending && failureOccurred);
    REQUIRE(g, remapped_rows);
    *corrRows = (unsigned int)VAL(g, remapped_rows, 0);
    *uncRows = (unsigned int)VAL(g, remapped_rows, 1);
    *isPending = (unsigned int)VAL(g, remapped_rows, 2);
    *failureOccurred = (unsigned int)VAL(g, remapped_rows, 3);
    END(NVML_SUCCESS);
}

UINT_GETTER(nvmlDeviceGetRetiredPagesPendingStatus, retired_pages_pending, 0)

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, unsigned int errorType, unsigned int counterType,
                                         unsigned long long *count)
{
    BEGIN_DEV(nvmlDeviceGetTotalEccErrors, dev);
    NEED(count && errorType < 2 && counterType < 2);
    if (!(g->ecc_has >> (errorType * 2 + counterType) & 1U) || g->ecc[errorType][counterType] == NA)
        END(NVML_ERROR_NOT_SUPPORTED);
    *count = (unsigned long long)g->ecc[errorType][counterType];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending)
{
    BEGIN_DEV(nvmlDeviceGetEccMode, dev);
    NEED(current && pending);
    REQUIRE(g, ecc_mode);
    *current = (unsigned int)VAL(g, ecc_mode, 0);
    *pending = (unsigned int)VAL(g, ecc_mode, 1);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Field values                                                              */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int valuesCount, nvmlFieldValue_t *values)
{
    BEGIN_DEV(nvmlDeviceGetFieldValues, dev);
    NEED(valuesCount >= 0 && (valuesCount == 0 || values));
    long long ts = realtime_us();
    int any_ok = 0, first_err = 0;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        int ret;
        field_t *f = NULL;
#ifdef FAKE_OLD_DRIVER
        if (v->fieldId > 200)
            ret = NVML_ERROR_INVALID_ARGUMENT;
        else
#endif
        {
            f = field_slot(g, v->fieldId, v->scopeId, 0);
            if (f && f->err)
                ret = f->err;
            else if (f && f->has_value && valuesCount >= f->min_batch)
                ret = NVML_SUCCESS;
            else
                ret = NVML_ERROR_NOT_SUPPORTED;
        }
        v->timestamp = ts;
        v->latencyUsec = 0;
        v->nvmlReturn = ret;
        if (ret == NVML_SUCCESS) {
            v->valueType = f->type;
            v->value = f->value;
            any_ok = 1;
        } else {
            /* "value is undefined": poison it so unchecked reads stand out */
            v->valueType = 0;
            v->value.ullVal = 0xDEADBEEFDEADBEEFULL;
            if (!first_err)
                first_err = ret;
        }
    }
    if (valuesCount == 0 || any_ok)
        END(NVML_SUCCESS);
    END(g_state->fv_all_failed >= 0 ? g_state->fv_all_failed : first_err);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                    */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlEventSetCreate);
    if (r)
        return r;
    NEED(set);
    struct fake_evset *es = calloc(1, sizeof *es);
    if (!es)
        END(20); /* NVML_ERROR_MEMORY */
    es->magic = EVSET_MAGIC;
    es->watch_fd = -1;
    *set = es;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t dev, unsigned long long *types)
{
    BEGIN_DEV(nvmlDeviceGetSupportedEventTypes, dev);
    NEED(types);
    REQUIRE(g, supported_event_types);
    *types = (unsigned long long)VAL(g, supported_event_types, 0);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, nvmlEventSet_t set)
{
    BEGIN_DEV(nvmlDeviceRegisterEvents, dev);
    NEED(set && set->magic == EVSET_MAGIC);
    REQUIRE(g, supported_event_types);
    if (types & ~(unsigned long long)VAL(g, supported_event_types, 0))
        END(NVML_ERROR_NOT_SUPPORTED); /* registers none */
    int gi = (int)(g - g_state->gpus);
    set->mask[gi] |= types;
    if (g_state->xid_after_register) {
        for (int i = 0; i < g_state->nxid; i++)
            if (g_state->xids[i].gpu == gi && g_state->xids[i].seq > set->last_seq[gi])
                set->last_seq[gi] = g_state->xids[i].seq;
    }
    END(NVML_SUCCESS);
}

/* Caller holds g_mu. Returns 1 and fills data when an event was delivered. */
static int next_event(struct fake_evset *set, nvmlEventData_t *data)
{
    const state_t *st = g_state;
    const xid_t *best = NULL;
    for (int i = 0; i < st->nxid; i++) {
        const xid_t *x = &st->xids[i];
        if (x->gpu >= st->gpu_count || !(set->mask[x->gpu] & x->type) || x->seq <= set->last_seq[x->gpu])
            continue;
        if (!best || x->seq < best->seq)
            best = x;
    }
    if (!best)
        return 0;
    set->last_seq[best->gpu] = best->seq;
    data->device = &g_devs[best->gpu];
    data->eventType = best->type;
    data->eventData = best->xid;
    data->gpuInstanceId = NO_INSTANCE;
    data->computeInstanceId = NO_INSTANCE;
    return 1;
}

/* An inotify descriptor watching the state file's directory (the file is replaced by a rename, so the
 * directory is what sees it), or -1: inotify refused, or no state file; ``name`` gets the file's name in
 * that directory. Made with g_mu held. */
static int watch_state(char *name, size_t size)
{
    if (!g_state_path)
        return -1;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    char dir[PATH_MAX];
    const char *slash = strrchr(g_state_path, '/');
    const char *base = slash ? slash + 1 : g_state_path;
    size_t n = !slash ? 1 : slash == g_state_path ? 1 : (size_t)(slash - g_state_path); /* ".", "/" or the path */
    if (n < sizeof dir) {
        memcpy(dir, slash ? g_state_path : ".", n);
        dir[n] = 0;
    }
    if (n >= sizeof dir || strlen(base) >= size ||
        inotify_add_watch(fd, dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_MODIFY | IN_CREATE) < 0) {
        close(fd);
        return -1;
    }
    strcpy(name, base);
    return fd;
}

/* Sleep until the state file changes (1: an inotify event named it) or ``ns`` pass (0). Without a watch
 * (fd < 0) it sleeps 10 ms, the library's old poll. With one it wakes at the latest every
 * EVENT_RECHECK_NS even so: nvmlShutdown from another thread, a file system whose changes inotify does
 * not see. Called without g_mu. */
#define EVENT_RECHECK_NS 100000000LL
static int wait_for_state(int fd, const char *name, long long ns)
{
    if (fd < 0) {
        sleep_ns(ns < 10000000LL ? ns : 10000000LL);
        return 0;
    }
    if (ns > EVENT_RECHECK_NS)
        ns = EVENT_RECHECK_NS;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, (int)((ns + 999999) / 1000000)) <= 0)
        return 0;
    int named = 0;
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    ssize_t len;
    while ((len = read(fd, buf, sizeof buf)) > 0) {
        for (char *at = buf; at < buf + len;) {
            const struct inotify_event *ev = (const struct inotify_event *)at;
            if (ev->len && strcmp(ev->name, name) == 0)
                named = 1;
            at += sizeof *ev + ev->len;
        }
    }
    return named;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlEventSetWait_v2);
    if (r)
        return r;
    NEED(set && set->magic == EVSET_MAGIC && data);
    long long deadline = mono_ns() + (long long)timeoutms * 1000000LL;
    int watching = 0;
    set->waiters++;
    for (;;) {
        if (g_init_count <= 0 || !g_state) {
            r = NVML_ERROR_UNINITIALIZED;
            break;
        }
        if (next_event(set, data)) {
            r = NVML_SUCCESS;
            break;
        }
        long long left = deadline - mono_ns();
        if (left <= 0) {
            r = NVML_ERROR_TIMEOUT;
            break;
        }
        if (!watching) { /* watched before the state is looked at again: no change falls between the two */
            watching = 1;
            if (set->watch_fd < 0)
                set->watch_fd = watch_state(set->watch_name, sizeof set->watch_name);
            maybe_reload(1);
            continue;
        }
        int fd = set->watch_fd;
        pthread_mutex_unlock(&g_mu);
        int changed = wait_for_state(fd, set->watch_name, left);
        pthread_mutex_lock(&g_mu);
        maybe_reload(changed);
        count_cpu_so_far();
    }
    set->waiters--;
    END(r);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlEventSetFree);
    if (r)
        return r;
    NEED(set && set->magic == EVSET_MAGIC);
    if (set->waiters) /* NVML does not say what happens: the waiter would read freed memory; the fake refuses */
        END(NVML_ERROR_IN_USE);
    set->magic = 0;
    if (set->watch_fd >= 0)
        close(set->watch_fd);
    free(set);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Processes                                                                 */
/* ------------------------------------------------------------------------ */

static nvmlReturn_t running_processes(int sym, int kind, nvmlDevice_t dev, unsigned int *count,
                                      nvmlProcessInfo_t *infos)
{
    gpu_t *g;
    nvmlReturn_t r = dev_begin(sym, dev, &g);
    if (r)
        return r;
    NEED(count);
    unsigned int n = (unsigned int)g->nproc[kind];
    if (n == 0) {
        *count = 0;
        END(NVML_SUCCESS);
    }
    if (*count < n || !infos) {
        *count = n;
        END(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = g->procs[kind][i].pid;
        infos[i].usedGpuMemory = g->procs[kind][i].used;
        infos[i].gpuInstanceId = g->procs[kind][i].gi;
        infos[i].computeInstanceId = g->procs[kind][i].ci;
    }
    *count = n;
    END(NVML_SUCCESS);
}

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return running_processes(SYM_nvmlDeviceGetComputeRunningProcesses_v3, 0, dev, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count,
                                                      nvmlProcessInfo_t *infos)
{
    return running_processes(SYM_nvmlDeviceGetGraphicsRunningProcesses_v3, 1, dev, count, infos);
}
#endif

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return running_processes(SYM_nvmlDeviceGetComputeRunningProcesses_v2, 0, dev, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t dev, unsigned int *count,
                                                      nvmlProcessInfo_t *infos)
{
    return running_processes(SYM_nvmlDeviceGetGraphicsRunningProcesses_v2, 1, dev, count, infos);
}

/* ------------------------------------------------------------------------ */
/* GPM (GPU performance monitoring, Hopper and newer)                        */
/* ------------------------------------------------------------------------ */
/*
 * State: "gpm_supported 1" makes nvmlGpmQueryDeviceSupport say yes (without it
 * the call succeeds with isSupportedDevice 0, as on pre-Hopper GPUs, and
 * nvmlGpmSampleGet answers NOT_SUPPORTED); "gpm <metricId> <value>" gives a
 * metric's value (a double, the average over any pair of samples); metrics
 * without a line get a per-metric NOT_SUPPORTED. Samples are opaque
 * allocations that remember the GPU and the CLOCK_MONOTONIC time of their
 * nvmlGpmSampleGet; nvmlGpmMetricsGet wants two samples of the same GPU, the
 * second taken later than the first.
 */

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

typedef struct fake_gpm_sample {
    unsigned int magic;
    int gpu;  /* -1 until filled */
    int slot; /* the MIG device's slot for nvmlGpmMigSampleGet, -1 for the whole GPU */
    long long t_ns;
} *nvmlGpmSample_t;
#define GPM_MAGIC 0x47504d53U
#define GPM_METRIC_MAX 477 /* pynvml's NVML_GPM_METRIC_MAX */

typedef struct {
    const char *shortName;
    const char *longName;
    const char *unit;
} nvmlGpmMetricInfo_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t; /* 40 bytes */

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;

#if NEW_SYMBOL
static int gpm_on(const gpu_t *g)
{
    return HAS(g, gpm_supported) && VAL(g, gpm_supported, 0) == 1;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t dev, nvmlGpmSupport_t *support)
{
    BEGIN_DEV(nvmlGpmQueryDeviceSupport, dev);
    NEED(support);
    if (support->version != 1)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    support->isSupportedDevice = gpm_on(g) ? 1U : 0U;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlGpmSampleAlloc);
    if (r)
        return r;
    NEED(sample);
    struct fake_gpm_sample *s = calloc(1, sizeof *s);
    if (!s)
        END(NVML_ERROR_INSUFFICIENT_SIZE);
    s->magic = GPM_MAGIC;
    s->gpu = -1;
    s->slot = -1;
    *sample = s;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample)
{
    nvmlReturn_t r = sys_begin(SYM_nvmlGpmSampleFree);
    if (r)
        return r;
    NEED(sample && sample->magic == GPM_MAGIC);
    sample->magic = 0;
    free(sample);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t dev, nvmlGpmSample_t sample)
{
    BEGIN_DEV(nvmlGpmSampleGet, dev);
    NEED(sample && sample->magic == GPM_MAGIC);
    if (!gpm_on(g) || (HAS(g, mig_mode) && VAL(g, mig_mode, 0) == 1)) /* with MIG on: per instance only */
        END(NVML_ERROR_NOT_SUPPORTED);
    sample->gpu = dev_index(dev);
    sample->slot = -1;
    sample->t_ns = mono_ns();
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t dev, unsigned int gpuInstanceId, nvmlGpmSample_t sample)
{
    BEGIN_DEV(nvmlGpmMigSampleGet, dev);
    NEED(sample && sample->magic == GPM_MAGIC);
    if (!gpm_on(g))
        END(NVML_ERROR_NOT_SUPPORTED);
    int slot = -1;
    for (int i = 0; i < MAX_MIG; i++)
        if (g->mig[i].present && g->mig[i].gi == gpuInstanceId)
            slot = i;
    if (slot < 0)
        END(NVML_ERROR_NOT_FOUND);
    sample->gpu = dev_index(dev);
    sample->slot = slot;
    sample->t_ns = mono_ns();
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m)
{
    count_call(SYM_nvmlGpmMetricsGet);
    if (!m || m->version != 1 || !m->sample1 || !m->sample2 || m->sample1->magic != GPM_MAGIC ||
        m->sample2->magic != GPM_MAGIC)
        return m && m->version != 1 ? NVML_ERROR_ARGUMENT_VERSION_MISMATCH : NVML_ERROR_INVALID_ARGUMENT;
    gpu_t *g;
    nvmlReturn_t r = gpu_begin(SYM_nvmlGpmMetricsGet, m->sample1->gpu, &g);
    if (r)
        return r;
    NEED(m->sample1->gpu >= 0 && m->sample1->gpu == m->sample2->gpu && m->sample1->slot == m->sample2->slot);
    int ngpm = g->ngpm;
    const unsigned int *ids = g->gpm_id;
    const double *values = g->gpm_value;
    if (m->sample1->slot >= 0) { /* a MIG instance's metrics */
        mig_t *mig = &g->mig[m->sample1->slot];
        ngpm = mig->ngpm;
        ids = mig->gpm_id;
        values = mig->gpm_value;
    }
    NEED(m->sample2->t_ns > m->sample1->t_ns && m->numMetrics <= GPM_METRIC_MAX);
    for (unsigned int i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        x->value = 0.0;
        memset(&x->metricInfo, 0, sizeof x->metricInfo);
        for (int k = 0; k < ngpm; k++)
            if (ids[k] == x->metricId) {
                x->nvmlReturn = NVML_SUCCESS;
                x->value = values[k];
                break;
            }
    }
    END(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* GPU fabric (NVSwitch systems)                                             */
/* ------------------------------------------------------------------------ */
/*
 * State: "fabric <state> <status> <cliqueId> <healthMask>" and
 * "fabric_cluster_uuid <32 hex digits>" (default all zero). Without a fabric
 * line both calls answer NOT_SUPPORTED (a PCIe card). "fabric_summary <n>"
 * (NVML_GPU_FABRIC_HEALTH_SUMMARY_*): the driver knows the v3 structure
 * (R570+) and answers it with that summary; without the line it is a driver
 * before R570, which answers the v3 version ARGUMENT_VERSION_MISMATCH (the
 * version is checked before anything else, as NVML does).
 */

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t; /* 28 bytes */

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfo_v3_t;
#define nvmlGpuFabricInfo_v2 0x02000024U /* sizeof the v2 struct (36) | 2 << 24 */
#define nvmlGpuFabricInfo_v3 STRUCT_VERSION(nvmlGpuFabricInfo_v3_t, 3) /* 0x03000028 */

static void fabric_uuid(const gpu_t *g, unsigned char out[16])
{
    memset(out, 0, 16);
    if (!(g->str_present >> S_FABRIC_CLUSTER & 1U))
        return;
    const char *s = g->str[S_FABRIC_CLUSTER];
    for (int i = 0; i < 16 && s[2 * i] && s[2 * i + 1]; i++) {
        unsigned int byte;
        if (sscanf(s + 2 * i, "%2x", &byte) != 1)
            return;
        out[i] = (unsigned char)byte;
    }
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t dev, nvmlGpuFabricInfo_t *info)
{
    BEGIN_DEV(nvmlDeviceGetGpuFabricInfo, dev);
    NEED(info);
    REQUIRE(g, fabric);
    fabric_uuid(g, info->clusterUuid);
    info->state = (unsigned int)VAL(g, fabric, 0);
    info->status = (nvmlReturn_t)VAL(g, fabric, 1);
    info->cliqueId = (unsigned int)VAL(g, fabric, 2);
    END(NVML_SUCCESS);
}

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t dev, nvmlGpuFabricInfo_v3_t *info)
{
    BEGIN_DEV(nvmlDeviceGetGpuFabricInfoV, dev);
    NEED(info);
    if (info->version != nvmlGpuFabricInfo_v2 &&
        (info->version != nvmlGpuFabricInfo_v3 || !HAS(g, fabric_summary)))
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(g, fabric);
    fabric_uuid(g, info->clusterUuid);
    info->state = (unsigned int)VAL(g, fabric, 0);
    info->status = (nvmlReturn_t)VAL(g, fabric, 1);
    info->cliqueId = (unsigned int)VAL(g, fabric, 2);
    info->healthMask = (unsigned int)VAL(g, fabric, 3);
    if (info->version == nvmlGpuFabricInfo_v3)
        info->healthSummary = (unsigned char)VAL(g, fabric_summary, 0);
    END(NVML_SUCCESS);
}
#endif

/* ------------------------------------------------------------------------ */
/* C2C mode (Grace-coupled GPUs: GH200, GB200)                               */
/* ------------------------------------------------------------------------ */
/*
 * State: "c2c_mode <isC2cEnabled>"; without it the call answers NOT_SUPPORTED.
 * The structure has no version member (nvml.h: nvmlC2cModeInfo_v1_t is one
 * unsigned int); the C2C link fields 170-172 and 231-234 are "field" lines.
 */

typedef struct {
    unsigned int isC2cEnabled;
} nvmlC2cModeInfo_v1_t;

#if NEW_SYMBOL
nvmlReturn_t nvmlDeviceGetC2cModeInfoV(nvmlDevice_t dev, nvmlC2cModeInfo_v1_t *info)
{
    BEGIN_DEV(nvmlDeviceGetC2cModeInfoV, dev);
    NEED(info);
    REQUIRE(g, c2c_mode);
    info->isC2cEnabled = (unsigned int)VAL(g, c2c_mode, 0);
    END(NVML_SUCCESS);
}
#endif

/* NVLink version: "nvlink_version <enum>" (the same for every link below MAX_LINKS). */
nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t dev, unsigned int link, unsigned int *version)
{
    BEGIN_DEV(nvmlDeviceGetNvLinkVersion, dev);
    NEED(version);
    NEED(link < MAX_LINKS);
    REQUIRE(g, nvlink_version);
    *version = (unsigned int)VAL(g, nvlink_version, 0);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* NVLink remote ends                                                        */
/* ------------------------------------------------------------------------ */
/*
 * State: "nvlink_remote <link> <type> <pci bus id>" (type: GPU 0, IBMNPU 1,
 * SWITCH 2, UNKNOWN 255). Links without a line answer NOT_SUPPORTED (an
 * inactive or absent link).
 */

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t dev, unsigned int link, unsigned int *type)
{
    BEGIN_DEV(nvmlDeviceGetNvLinkRemoteDeviceType, dev);
    NEED(type);
    NEED(link < MAX_LINKS);
    if (!(g->nvl_remote_has >> link & 1ULL))
        END(NVML_ERROR_NOT_SUPPORTED);
    *type = g->nvl_remote_type[link];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t dev, unsigned int link, nvmlPciInfo_t *pci)
{
    BEGIN_DEV(nvmlDeviceGetNvLinkRemotePciInfo_v2, dev);
    NEED(pci);
    NEED(link < MAX_LINKS);
    if (!(g->nvl_remote_has >> link & 1ULL))
        END(NVML_ERROR_NOT_SUPPORTED);
    unsigned int dom = 0, bus = 0, device = 0, fn = 0;
    memset(pci, 0, sizeof *pci);
    if (sscanf(g->nvl_remote_bus[link], "%x:%x:%x.%x", &dom, &bus, &device, &fn) == 4) {
        pci->domain = dom;
        pci->bus = bus;
        pci->device = device;
    }
    snprintf(pci->busId, sizeof pci->busId, "%s", g->nvl_remote_bus[link]);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, bus, device, fn);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* MIG                                                                       */
/* ------------------------------------------------------------------------ */
/*
 * State: "mig_mode <current> <pending>" (without it: NOT_SUPPORTED, a GPU
 * without MIG); "mig <slot> <gi> <ci> <total bytes> <used bytes> <uuid>
 * <name to the end of the line>" for each MIG device (slot = the index of
 * nvmlDeviceGetMigDeviceHandleByIndex); "mig_gpm <slot> <metricId> <value>"
 * for the GPM metrics of that instance (nvmlGpmMigSampleGet with its gi).
 * MIG handles answer GetUUID, GetName, GetMemoryInfo, GetGpuInstanceId,
 * GetComputeInstanceId; a handle whose slot has no line (a destroyed
 * instance) answers INVALID_ARGUMENT.
 */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending)
{
    BEGIN_DEV(nvmlDeviceGetMigMode, dev);
    NEED(current && pending);
    REQUIRE(g, mig_mode);
    *current = (unsigned int)VAL(g, mig_mode, 0);
    *pending = (unsigned int)VAL(g, mig_mode, 1);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count)
{
    BEGIN_DEV(nvmlDeviceGetMaxMigDeviceCount, dev);
    NEED(count);
    REQUIRE(g, mig_mode);
    *count = VAL(g, mig_mode, 0) == 1 ? MAX_MIG : 0;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index, nvmlDevice_t *mig)
{
    BEGIN_DEV(nvmlDeviceGetMigDeviceHandleByIndex, dev);
    NEED(mig && index < MAX_MIG);
    if (!HAS(g, mig_mode) || VAL(g, mig_mode, 0) != 1)
        END(NVML_ERROR_NOT_SUPPORTED);
    if (!g->mig[index].present)
        END(NVML_ERROR_NOT_FOUND);
    *mig = &g_migs[dev_index(dev)][index];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    gpu_t *g;
    mig_t *m;
    nvmlReturn_t r = mig_begin(SYM_nvmlDeviceGetDeviceHandleFromMigDeviceHandle, migDevice, &g, &m);
    if (r)
        return r;
    NEED(device);
    *device = &g_devs[g - g_state->gpus];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *isMig)
{
    int gi, slot;
    nvmlReturn_t r = sys_begin(SYM_nvmlDeviceIsMigDeviceHandle);
    if (r)
        return r;
    NEED(isMig);
    *isMig = mig_handle(dev, &gi, &slot) ? 1U : 0U;
    END(NVML_SUCCESS);
}

/* The GPU instance id (compute = 0) or the compute instance id (compute = 1) of a MIG device. */
static nvmlReturn_t mig_instance_id(int sym, nvmlDevice_t dev, unsigned int *id, int compute)
{
    gpu_t *g;
    mig_t *m;
    nvmlReturn_t r = mig_begin(sym, dev, &g, &m);
    if (r)
        return r;
    NEED(id);
    *id = compute ? m->ci : m->gi;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    return mig_instance_id(SYM_nvmlDeviceGetGpuInstanceId, dev, id, 0);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t dev, unsigned int *id)
{
    return mig_instance_id(SYM_nvmlDeviceGetComputeInstanceId, dev, id, 1);
}
