/**
 * Generated from the server's own definitions: the REST API's JSON shapes from
 * jupyter_gpushare/server/openapi.yaml (the contract), which actions each state allows from
 * jupyter_gpushare/core/lifecycle.py (`ACTIONS`), and the kernel event from
 * jupyter_gpushare/events/kernel-v1.yaml. Do not edit: change those, then run
 * `python -m jupyter_gpushare.server.contract_typescript`.
 */

/** jupyter_server's error body. */
export interface IError {
  /** What went wrong, for a person to act on. */
  message: string;
  /** The HTTP reason phrase when the server set one; usually null. */
  reason: string | null;
}

export interface IPinRequest {
  /** true = never release automatically; false = again. */
  pinned: boolean;
}

export interface ICapRequest {
  /**
   * Bytes per GPU (1 up to 1 PiB); null = back to the default. Above the kernel's ceiling (its
   * kernelspec's or the admin's cap): 409.
   */
  memory_cap: number | null;
}

/** The kernel's state (see docs/how-it-works.md, Kernel states). */
export type KernelState =
  'active' | 'idle' | 'releasing' | 'released' | 'restoring' | 'failed' | 'untracked';

/** Every `KernelState`, in the contract's order. */
export const KernelStateValues: readonly KernelState[] = [
  'active',
  'idle',
  'releasing',
  'released',
  'restoring',
  'failed',
  'untracked'
];

/**
 * What brings a released kernel back: `eager` restores before any cell runs; `lazy` only before a
 * cell that may use the GPU, judged from its code.
 */
export type RestoreMode = 'eager' | 'lazy';

/** Every `RestoreMode`, in the contract's order. */
export const RestoreModeValues: readonly RestoreMode[] = ['eager', 'lazy'];

/**
 * A release method: `driver`, `framework`, `simulated`, or `off` (none). Methods are an open set (a
 * registry), so this is any name.
 */
export type Method = string;

export interface IStatus {
  /** `nvml`, `simulated`, or the name of a custom telemetry class. */
  backend: string;
  /**
   * The machine this server's GPUs are in: the environment's JUPYTER_GPUSHARE_NODE (on Kubernetes,
   * the node's name from the downward API), else the host name. The hub service groups GPUs into
   * nodes by it.
   */
  node: string;
  /** This server's release method. */
  method: Method;
  /** Whether the telemetry source answers. */
  available: boolean;
  /** Why it is unavailable; "" when available. */
  reason: string;
  /** The server's idle_timeout (s); 0 = never release automatically. */
  idle_timeout: number;
  /** As in effect (lazy falls back to eager with the framework method). */
  restore_mode: RestoreMode;
  /** One entry per GPU (or MIG instance), by index. */
  gpus: IGPU[];
  /** One entry per kernel of this server, GPU user or not. */
  kernels: IKernel[];
  /**
   * The node-wide gpushare service of a JupyterHub (shares, usage, the admin page); null when this
   * server is not linked to one.
   */
  hub: IHub | null;
}

/** What the gpushare hub service says about this server's user. */
export interface IHub {
  /** The service as this server reaches it. */
  service_url: string;
  /** The service answered the last request. */
  connected: boolean;
  /** Why the last request to the service failed; null when it answered. */
  error: string | null;
  /** This server's JupyterHub user. */
  user: string;
  /** The service's admin page (a path on the Hub); null unless the user is an admin. */
  admin_url: string | null;
  /**
   * The user's guaranteed GPU memory, in words ("8.0 GiB per gpu (user alice)"); null when none is
   * guaranteed or shares are off.
   */
  share: string | null;
  /** The user's GPU memory (all their servers) on each GPU this server sees. */
  usage: IHubUsage[];
  /**
   * The user holds more than their share somewhere: their idle kernels are released first and
   * sooner to make room for others.
   */
  over_share: boolean;
  /**
   * The admin's memory cap for the user's kernels (the service's caps table), bytes per GPU; every
   * kernel of this server is capped at it, those running when it changes too (at the next poll).
   * null = none.
   */
  cap: number | null;
}

export interface IHubUsage {
  /** The GPU's index on this server. */
  index: number;
  /** Bytes the user's kernels hold on it now. */
  bytes: number;
  /** Bytes their share guarantees there (per-node shares count the whole node); null = none. */
  guaranteed: number | null;
}

export interface IGPU {
  /** NVML index; MIG instances are numbered after all physical GPUs. */
  index: number;
  /** As NVML reports it ("" when it cannot). */
  uuid: string;
  /** As NVML reports it ("unavailable" when it cannot). */
  name: string;
  /** Bytes; null when unreadable. */
  memory_total: number | null;
  /** Bytes in use by every process on the GPU; null when unreadable. */
  memory_used: number | null;
  /** SM busy %, last sample; null for MIG instances or when unreadable. */
  utilization: number | null;
  /** Bytes this server's released kernels hold in host memory for this GPU. */
  released_bytes: number;
  /**
   * Bytes this server's kernels will still bring onto this GPU, each kernel counted once: a
   * released kernel's held state (a restore waiting for memory: what it needs here, when more), and
   * what restores in flight reserved here and has not landed yet (landed bytes are in memory_used).
   * Free memory less this is the GPU's room as the hub service ranks it. Absent from servers before
   * it was added.
   */
  returning_bytes?: number;
  /**
   * Of returning_bytes, what this server's restores in flight reserved on this GPU and has not
   * landed yet (not in memory_used yet): the hub service counts it when it makes room for another
   * server's restore. Absent from servers before it was added.
   */
  restoring_bytes?: number;
  /**
   * Bytes this server's kernels placed on this GPU that have not used it yet are expected to
   * allocate there (each kernel's expected need: its kernelspec, else what its person's kernels
   * held before, else context_bytes). The release policy counts them as wanted memory; the hub
   * service tells the other servers on the node their sum. Absent from servers before it was added.
   */
  placed_bytes?: number;
  /** This entry is a MIG instance. */
  mig: boolean;
  /**
   * SM busy %, mean over the rebalance window (5 x rebalance_idle, at least load_window: the last
   * 10 minutes by default; or since the server started), every process on the GPU counted: the
   * GPU's compute demand against 100 %.
   */
  load?: number;
  /**
   * Two or more of this server's kernels computed on the GPU within the window and its SMs were
   * busy at least 90 % of it: their cells slow each other down (an idle one may be moved,
   * c.GPUShareApp.rebalance).
   */
  contended?: boolean;
  /** Ids of this server's kernels that computed on the GPU within the window. */
  computing?: string[];
}

export interface IKernel {
  /** Kernel id. */
  id: string;
  /** Kernelspec name ("" when not known yet). */
  name: string;
  /** Notebook path from the session; "" for a kernel without a session. */
  path: string;
  /** The kernel process and its descendants. */
  pids: number[];
  state: KernelState;
  /** Never released automatically. */
  pinned: boolean;
  /** Bytes on the GPU now, all GPUs. */
  gpu_memory_bytes: number;
  /** Bytes of GPU state held in host memory while released; 0 otherwise. */
  released_bytes: number;
  /**
   * GPU indices the kernel uses now, holds state for, or was placed on at start (-1 = GPU unknown).
   */
  gpus: number[];
  /** Bytes on the GPU now, per GPU index ("-1" = GPU unknown). */
  gpu_bytes: { [key: string]: number };
  /**
   * SM % of the kernel's processes, last sample, on the busiest of its GPUs (the highest value of
   * gpu_utilization); null with no GPU memory.
   */
  sm_utilization: number | null;
  /**
   * SM % of the kernel's processes on each GPU it holds memory on, last sample (the same keys as
   * gpu_bytes); 0 where no per-process figure was sampled.
   */
  gpu_utilization: { [key: string]: number };
  /** Seconds since the last activity; 0 while busy; null when not tracked yet. */
  idle_seconds: number | null;
  /**
   * Seconds until the automatic idle release if nothing changes (under release_policy "needs": when
   * the long-idle release is due; it happens then only if the kernel's GPU has less than
   * long_idle_free_fraction free); memory pressure or a waiting restore may release the kernel
   * sooner. null = none scheduled.
   */
  release_in_seconds: number | null;
  /**
   * The server's release_policy: "needs" releases an idle kernel when its GPU needs the memory (or
   * after long_idle), "proactive" also at its idle timeout.
   */
  release_policy?: 'needs' | 'proactive';
  /** This kernel's effective idle timeout (override, else the server's). */
  idle_timeout: number;
  /**
   * The method that holds the kernel's state (released, restoring, failed); else the one its next
   * release would use (with release_method auto, this kernel's pick); null = none.
   */
  method: Method | null;
  /** Successful releases since the server started. */
  releases: number;
  /** Successful restores since the server started. */
  restores: number;
  /** Duration of the last restore (s). */
  last_restore_seconds: number | null;
  /** Duration of the last release (s). */
  last_release_seconds: number | null;
  /** The last failure. */
  error: string | null;
  /**
   * Why a restore waits (for memory, another server's restore turn); null when none waits. While a
   * restore ahead of the next cell is on its way: "restoring ahead of your next cell" (then "; "
   * and the wait, if it waits).
   */
  waiting: string | null;
  /** jupyter_server's execution_state (idle, busy, starting, ...; unknown). */
  execution_state: string;
  /**
   * The kernel's last move off a contended GPU (c.GPUShareApp.rebalance), for example "GPU 0 -> 3:
   * GPU 0 busy", while it stays there; null when it has not moved since its last restore.
   */
  moved?: string | null;
  /**
   * Where the last restore put the GPU state when it moved it onto other GPUs
   * (c.GPUShareApp.restore_move_after), for example "onto GPU 1: GPU 0 had no room"; null when it
   * came back where it was.
   */
  restored_onto: string | null;
  /**
   * What the release method said about the release that holds the state now (for example "3 objects
   * left on the GPU": tensors it could not move); null when nothing is held or it said nothing.
   */
  release_detail: string | null;
  /**
   * Why this kernel is not released automatically although it may be idle (threads other than its
   * cells use the GPU; its GPU state would not fit in host memory); null when nothing stops it. A
   * release by hand is still possible.
   */
  release_blocked: string | null;
  /**
   * Host memory the kernel's process may still use, in bytes (the tightest of its memory cgroup and
   * the machine's MemAvailable); null when it cannot be read.
   */
  host_room_bytes: number | null;
  /**
   * GPU bytes of the kernel whose host copy, kept since its last restore or made by a pre-copy
   * while idle, is still current: a release moves them without copying (framework and simulated
   * methods); null when the kernel's agent did not say.
   */
  host_copy_bytes?: number | null;
  /**
   * GPU bytes a release would copy to host memory now: written or made since their host copy (the
   * driver method copies everything); null when the kernel's agent did not say.
   */
  to_copy_bytes?: number | null;
  /**
   * The kernel's memory cap in bytes per GPU (its own, else its kernelspec's memory_limit or the
   * admin's default, the smaller); null = uncapped.
   */
  memory_cap: number | null;
  /**
   * When the node sees the kernel hold more than its cap on a GPU: "holds 9.1 GiB of its 8 GiB cap
   * on GPU 0"; else null.
   */
  over_cap: string | null;
  /**
   * While a restore waits: the bytes it needs free, per GPU index (keys are strings); empty
   * otherwise.
   */
  restore_need: { [key: string]: number };
}

export interface IHistory {
  /** The server's clock, Unix epoch seconds. */
  now: number;
  /** poll_interval (s). */
  interval: number;
  /** Series per GPU index (keys are strings). */
  gpus: { [key: string]: IGPUHistory };
  /** Series per kernel id (kernels that exited are not included). */
  kernels: { [key: string]: IKernelHistory };
}

/** One GPU's series; `t` is epoch seconds, the other arrays are aligned with it. */
export interface IGPUHistory {
  t: number[];
  memory_used: (number | null)[];
  utilization: (number | null)[];
}

/** One kernel's series; `t` is epoch seconds, the other arrays are aligned with it. */
export interface IKernelHistory {
  t: number[];
  gpu_memory_bytes: (number | null)[];
  sm_utilization: (number | null)[];
  /** Bytes held on each GPU index, aligned with `t`. */
  gpu: { [key: string]: (number | null)[] };
  /**
   * SM % of the kernel's processes on each GPU index, aligned with `t` (the same keys as `gpu`);
   * null where the kernel held nothing on that GPU at that time.
   */
  gpu_utilization: { [key: string]: (number | null)[] };
}

/** What a person may ask for a kernel (REST, the panel, `%gpushare`). */
export type KernelAction = 'release' | 'restore' | 'pin';

/**
 * The states in which the server takes each action (it answers 409 in the others), from
 * jupyter_gpushare/core/lifecycle.py `ACTIONS`. A restore asked while a release is in flight waits
 * for the release, then restores; one asked while a restore runs joins it.
 */
export const ALLOWED_IN: { readonly [action in KernelAction]: readonly KernelState[] } = {
  release: ['active', 'idle'],
  restore: ['releasing', 'released', 'restoring', 'failed'],
  pin: ['active', 'idle', 'releasing', 'released', 'restoring', 'failed', 'untracked']
};

/** The id of the kernel event's schema (jupyter_events), from its `$id`. */
export const KERNEL_EVENT_SCHEMA_ID = 'https://events.jupyter.org/jupyter_gpushare/kernel/v1';

/**
 * The kernel event's `action` field: what happened. moved: an idle kernel left a GPU whose SMs were
 * contended for a quiet one (a release, then a restore onto the new GPU, each with its own event).
 */
export type KernelEventAction =
  | 'released'
  | 'restored'
  | 'release_failed'
  | 'restore_failed'
  | 'restore_waiting'
  | 'pinned'
  | 'unpinned'
  | 'moved';

/**
 * Emitted when jupyter-gpushare releases a kernel's GPU memory, restores it, fails to, waits for
 * memory to restore it, moves an idle kernel off a contended GPU, or when a kernel is pinned or
 * unpinned.
 */
export interface IKernelEvent {
  /** The kernel's id. */
  kernel_id: string;
  /**
   * What happened. moved: an idle kernel left a GPU whose SMs were contended for a quiet one (a
   * release, then a restore onto the new GPU, each with its own event).
   */
  action: KernelEventAction;
  /**
   * Bytes moved off (released) or back onto (restored) the GPU; needed bytes for restore_waiting.
   */
  bytes?: number;
  /** How long the operation took. */
  seconds?: number;
  /**
   * The move's rate (released, restored): bytes divided by seconds, the whole operation as the
   * server timed it (the agent's or driver's round trip included).
   */
  bytes_per_second?: number;
  /** driver, framework or simulated. */
  method?: string;
  /** Why it happened, or why it failed. */
  reason?: string;
  /**
   * What asked for the restore (restore_waiting, restore_failed): gate, agent, magic, rest, panel,
   * activity (ahead of the person's next cell), watchdog, shutdown, rebalance (the restore of a
   * move). A restored event gives it as its reason.
   */
  trigger?: string;
  /** What the method said about a release (released), e.g. "3 objects left on the GPU". */
  detail?: string;
  /** The notebook's path, when known. */
  path?: string;
  /**
   * moved: the GPUs the kernel left, in the order of to_gpus (the state on from_gpus[i] went to
   * to_gpus[i]).
   */
  from_gpus?: number[];
  /** moved: the GPUs the kernel went to. */
  to_gpus?: number[];
}
