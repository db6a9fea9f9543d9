/**
 * Pure formatting helpers (no DOM) shared by the panel, the status bar and notifications.
 */
import type { IKernel, KernelState } from './contract';

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;
const KiB = 1024;

/** Bytes as a short binary-unit string: "1.2 GiB", "512 MiB", "—" when unknown. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '—';
  }
  const abs = Math.abs(bytes);
  if (abs >= GiB) {
    return `${(bytes / GiB).toFixed(1)} GiB`;
  }
  if (abs >= MiB) {
    return `${Math.round(bytes / MiB)} MiB`;
  }
  if (abs >= KiB) {
    return `${Math.round(bytes / KiB)} KiB`;
  }
  return `${Math.round(bytes)} B`;
}

/** A percentage rounded to an integer: "35 %", "—" when unknown. */
export function formatPercent(value: number | null | undefined): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '—';
  }
  return `${Math.round(value)} %`;
}

/**
 * A kernel's SM utilization: "SM 35 %", or per GPU when it holds memory on several, so a GPU
 * it only keeps data on shows as such: "SM 93 % on GPU 0 · 0 % on GPU 1".
 */
export function formatUtilization(k: Pick<IKernel, 'sm_utilization' | 'gpu_utilization'>): string {
  const perGPU = Object.entries(k.gpu_utilization ?? {}).filter(([index]) => index !== '-1');
  if (perGPU.length < 2) {
    return `SM ${formatPercent(k.sm_utilization)}`;
  }
  return (
    'SM ' + perGPU.map(([index, util]) => `${formatPercent(util)} on GPU ${index}`).join(' · ')
  );
}

/**
 * Seconds as a compact duration: "4.2 s", "45 s", "2 min 10 s", "1 h 5 min", "—" when unknown.
 *
 * Rounded once, to the smallest unit shown, before splitting into units, so a carry moves
 * into the larger unit: 119.6 s is "2 min", never "1 min 60 s".
 */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '—';
  }
  const s = Math.max(0, seconds);
  if (s < 9.95) {
    return `${s.toFixed(1)} s`; // 9.95 and up would read "10.0 s"
  }
  const wholeSeconds = Math.round(s);
  if (wholeSeconds < 60) {
    return `${wholeSeconds} s`;
  }
  if (wholeSeconds < 3600) {
    const m = Math.floor(wholeSeconds / 60);
    const rest = wholeSeconds % 60;
    return rest > 0 ? `${m} min ${rest} s` : `${m} min`;
  }
  const wholeMinutes = Math.round(s / 60);
  const h = Math.floor(wholeMinutes / 60);
  const m = wholeMinutes % 60;
  return m > 0 ? `${h} h ${m} min` : `${h} h`;
}

/** Byte-seconds as GiB-hours with enough digits for small windows: "0.012 GiB·h". */
export function formatGiBHours(byteSeconds: number): string {
  const value = byteSeconds / GiB / 3600;
  const digits = value >= 10 ? 1 : value >= 1 ? 2 : 3;
  return `${value.toFixed(digits)} GiB·h`;
}

/**
 * Short names for notebook paths that still tell them apart: each path's file name, with as
 * many of its parent folders as it takes to differ from every other path given
 * ("a/x.ipynb" and "b/x.ipynb" stay whole; "c/y.ipynb" alone is "y.ipynb"). Equal paths get
 * equal names (callers add what else differs, e.g. the kernel). Maps each path to its name.
 */
export function distinctNames(paths: Iterable<string>): Map<string, string> {
  const unique = [...new Set(paths)];
  const segments = new Map(unique.map(p => [p, p.split('/').filter(part => part !== '')]));
  const names = new Map<string, string>();
  for (const path of unique) {
    const mine = segments.get(path)!;
    let depth = 1;
    const clashes = (d: number) =>
      unique.some(other => other !== path && tail(segments.get(other)!, d) === tail(mine, d));
    while (depth < mine.length && clashes(depth)) {
      depth++;
    }
    const name = tail(mine, depth);
    names.set(path, depth < mine.length ? name : path);
  }
  return names;
}

function tail(parts: string[], count: number): string {
  return parts.slice(Math.max(0, parts.length - count)).join('/');
}

/**
 * A row name split for an ellipsis in the middle: the panel cuts `head` short with "…" when
 * the name does not fit and always shows `tail`, so "gpushare-demo.ipynb" reads
 * "gpushare-d…mo.ipynb" rather than "gpushare-demo.ip…". `tail` is the file extension with
 * the few characters before it, and a kernel suffix such as " (1a2b3c4d)" when there is one;
 * the last characters for a name without an extension. `head + tail` is always `name`.
 */
export function splitForEllipsis(name: string, keep = 4): { head: string; tail: string } {
  const match = /(\.[A-Za-z0-9_]{1,10})?( \([^()]*\))?$/.exec(name);
  const ending = match && (match[1] || match[2]) ? match[0] : '';
  let start = name.length - ending.length - (ending ? keep : 2 * keep);
  if (start <= 0) {
    return { head: name, tail: '' };
  }
  // Never split a surrogate pair (an emoji in a file name).
  const code = name.charCodeAt(start);
  if (code >= 0xdc00 && code <= 0xdfff) {
    start--;
  }
  return { head: name.slice(0, start), tail: name.slice(start) };
}

/** Tick spacings (seconds) a time axis may use, finest first. */
const TICK_STEPS = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600];

/**
 * Where a chart's time axis puts its ticks: at `to` ("now") and every `step` seconds before
 * it back to `from`, with the finest step from TICK_STEPS that gives at most `maxTicks`
 * ticks, so each tick reads as a round age ("-2 min", "-4 min"). Oldest first.
 */
export function relativeTicks(from: number, to: number, maxTicks: number): number[] {
  const span = Math.max(0, to - from);
  const most = Math.max(2, Math.floor(maxTicks));
  const step =
    TICK_STEPS.find(s => Math.floor(span / s) + 1 <= most) ??
    Math.ceil(span / (most - 1) / 3600) * 3600;
  const ticks: number[] = [];
  for (let k = Math.floor(span / step + 1e-9); k >= 0; k--) {
    ticks.push(to - k * step);
  }
  return ticks;
}

/**
 * A time axis label as an age from `now`: "now", "-30 s", "-5 min", "-1 h 30 min". Short
 * enough for a 250 px panel, and the same whatever the clock or time zone.
 */
export function relativeTimeLabel(t: number, now: number): string {
  const ago = Math.round(now - t);
  if (ago <= 0) {
    return 'now';
  }
  return ago < 60 ? `-${ago} s` : `-${formatDuration(ago)}`;
}

/** The kernel fields `timingClauses` reads. */
export type ITimingKernel = Pick<
  IKernel,
  | 'idle_seconds'
  | 'pinned'
  | 'release_in_seconds'
  | 'release_policy'
  | 'idle_timeout'
  | 'method'
  | 'last_restore_seconds'
>;

/**
 * A kernel row's second line: how long it has been idle, when it will be released (by its
 * own idle timeout when it has one, which `%gpushare idle-timeout` sets: the header only
 * gives the server's), its method, and how long its last restore took.
 * `serverIdleTimeout`: the server's idle_timeout (s).
 */
export function timingClauses(
  k: ITimingKernel,
  state: KernelState,
  serverIdleTimeout: number
): string[] {
  const parts: string[] = [];
  if (k.idle_seconds !== null && k.idle_seconds !== undefined) {
    parts.push(`idle ${formatDuration(k.idle_seconds)}`);
  }
  if (state === 'active' || state === 'idle') {
    const inSeconds = k.release_in_seconds;
    if (k.pinned) {
      parts.push('never released automatically');
    } else if (inSeconds === null || inSeconds === undefined || !(k.idle_timeout > 0)) {
      parts.push('no automatic release');
    } else if (k.release_policy === 'proactive' || k.idle_timeout !== serverIdleTimeout) {
      // the kernel's own timeout (or, proactive, the server's) decides
      parts.push(
        `release after ${formatDuration(k.idle_timeout)} idle (in ${formatDuration(inSeconds)})`
      );
    } else {
      // "needs": released only when its GPU needs the memory; after the server's long_idle
      // also when its GPU runs short of free memory (long_idle_free_fraction)
      parts.push(`release if GPU needs room, or in ${formatDuration(inSeconds)} if it is short`);
    }
  }
  if (k.method) {
    parts.push(`method ${k.method}`);
  }
  if (k.last_restore_seconds !== null && k.last_restore_seconds !== undefined) {
    // a duration, not an age: "last restore 4.9 s" read as "4.9 s ago"
    parts.push(`last restore took ${formatDuration(k.last_restore_seconds)}`);
  }
  return parts;
}
