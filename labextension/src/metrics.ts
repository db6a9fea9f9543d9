/**
 * Pure computations over the history API's series (no DOM, no clock): the efficiency
 * figure (memory held versus memory held while the GPU computed) and the per-GPU stack of
 * kernels' memory the chart draws.
 */

/** The parts of the history response these functions read. */
export interface IKernelSeries {
  t: number[];
  gpu_memory_bytes: (number | null)[];
  sm_utilization: (number | null)[];
  /** Bytes on each GPU index, aligned with `t`. */
  gpu?: { [index: string]: (number | null)[] };
  /** The kernel's SM % on each GPU index, aligned with `t`. */
  gpu_utilization?: { [index: string]: (number | null)[] };
}

export interface IEfficiency {
  /** Integral of bytes held over time (byte-seconds). */
  heldByteSeconds: number;
  /** The same integral counting only the time the kernel computed on the GPU holding them. */
  usedByteSeconds: number;
  /** used / held in [0, 1], or null when nothing was held. */
  ratio: number | null;
}

/**
 * Memory-time held versus memory-time held while utilized, summed over kernels and GPUs.
 *
 * Bytes on a GPU count as used only while the kernel's SM utilization *on that GPU* was
 * above 0: a kernel that computes on GPU 0 while it keeps data on GPU 1 uses GPU 0's bytes
 * and holds GPU 1's idle. Each sample holds until the next one (step integration); the last
 * sample of a series counts for `interval` seconds, bounded by the gap to `now`. When
 * `gpuIndex` is given, only that GPU counts, otherwise every GPU.
 */
export function efficiency(
  kernels: { [id: string]: IKernelSeries },
  interval: number,
  now: number,
  gpuIndex?: string
): IEfficiency {
  let held = 0;
  let used = 0;
  for (const id of Object.keys(kernels)) {
    const series = kernels[id];
    const indices = gpuIndex === undefined ? Object.keys(series.gpu ?? {}) : [gpuIndex];
    for (const index of indices) {
      const bytes = series.gpu?.[index];
      if (!bytes) {
        continue;
      }
      const utilization = series.gpu_utilization?.[index] ?? [];
      const t = series.t;
      for (let i = 0; i < t.length; i++) {
        const b = bytes[i];
        if (b === null || b === undefined || b <= 0) {
          continue;
        }
        const next = i + 1 < t.length ? t[i + 1] : Math.min(t[i] + interval, Math.max(now, t[i]));
        const dt = Math.max(0, next - t[i]);
        held += b * dt;
        const util = utilization[i];
        if (util !== null && util !== undefined && util > 0) {
          used += b * dt;
        }
      }
    }
  }
  return { heldByteSeconds: held, usedByteSeconds: used, ratio: held > 0 ? used / held : null };
}

/**
 * Resample `values` (at times `t`) onto the timestamps `x` by holding the latest sample at
 * or before each x, for at most `maxGap` seconds; 0 where there is no recent sample
 * (the kernel did not exist yet, or held nothing on this GPU).
 */
export function sampleAndHold(
  x: number[],
  t: number[],
  values: (number | null)[],
  maxGap: number
): number[] {
  const out = new Array<number>(x.length).fill(0);
  let j = 0;
  for (let i = 0; i < x.length; i++) {
    while (j + 1 < t.length && t[j + 1] <= x[i] + 1e-6) {
      j++;
    }
    if (t.length > 0 && t[j] <= x[i] + 1e-6 && x[i] - t[j] <= maxGap) {
      const v = values[j];
      out[i] = v === null || v === undefined ? 0 : v;
    }
  }
  return out;
}

/**
 * Each sample's value replaced by the highest value in its slot of time, slots being
 * `slotSeconds` long from the epoch (so they do not move as the window slides). Drawn as
 * steps, a burst shorter than a slot still fills a whole slot at its full height: a 5 s burst
 * in a 10-minute, 200 px chart would otherwise be a 2 px spike. Null where every sample of
 * the slot is null; `slotSeconds` of 0 or less keeps the values as they are.
 */
export function slotPeaks(
  x: number[],
  values: (number | null)[],
  slotSeconds: number
): (number | null)[] {
  if (!(slotSeconds > 0)) {
    return x.map((_, i) => values[i] ?? null);
  }
  const slotOf = (t: number) => Math.floor(t / slotSeconds);
  const peaks = new Map<number, number>();
  x.forEach((t, i) => {
    const v = values[i];
    if (v !== null && v !== undefined) {
      const slot = slotOf(t);
      peaks.set(slot, Math.max(peaks.get(slot) ?? -Infinity, v));
    }
  });
  return x.map(t => peaks.get(slotOf(t)) ?? null);
}

/** The highest known value, or null when none is known. */
export function peak(values: readonly (number | null | undefined)[]): number | null {
  let best: number | null = null;
  for (const v of values) {
    if (v !== null && v !== undefined && Number.isFinite(v) && (best === null || v > best)) {
      best = v;
    }
  }
  return best;
}

export interface IStack {
  /** Kernel ids in stacking order (bottom first). */
  ids: string[];
  /** Cumulative bytes, one array per kernel id: stack[k][i] = sum of kernels 0..k at x[i]. */
  cumulative: number[][];
}

/**
 * Stack the kernels' bytes on one GPU over the timestamps `x`, bottom first in the given
 * order. Kernels that hold nothing on this GPU during the window are left out.
 */
export function stackOnGPU(
  x: number[],
  kernels: { [id: string]: IKernelSeries },
  order: string[],
  gpuIndex: string,
  maxGap: number
): IStack {
  const ids: string[] = [];
  const cumulative: number[][] = [];
  let running = new Array<number>(x.length).fill(0);
  for (const id of order) {
    const series = kernels[id];
    const bytes = series?.gpu?.[gpuIndex];
    if (!series || !bytes) {
      continue;
    }
    const held = sampleAndHold(x, series.t, bytes, maxGap);
    if (!held.some(v => v > 0)) {
      continue;
    }
    running = running.map((v, i) => v + held[i]);
    ids.push(id);
    cumulative.push(running);
  }
  return { ids, cumulative };
}

/** The history response's shape, as far as merging needs it. */
export interface IHistoryLike {
  now: number;
  interval: number;
  gpus: { [index: string]: { t: number[]; [key: string]: any } };
  kernels: {
    [id: string]: {
      t: number[];
      gpu?: { [index: string]: (number | null)[] };
      gpu_utilization?: { [index: string]: (number | null)[] };
      [key: string]: any;
    };
  };
}

/** A field of a series that maps GPU indices to arrays aligned with `t` (`gpu`, ...). */
function isPerGPU(value: unknown): value is { [index: string]: (number | null)[] } {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * Append a short, recent history answer (`fresh`) to the one already held (`base`) in place,
 * and drop samples older than `windowSeconds` before `fresh.now`. Lets the panel ask the
 * server for the last few seconds each refresh instead of the whole window.
 *
 * Every array-valued field of a series other than `t`, and each array in a per-GPU map
 * (`gpu`, `gpu_utilization`), is aligned with `t`; a GPU index that first appears in
 * `fresh` is padded with nulls, and one missing from it is continued with nulls.
 */
export function mergeHistory<H extends IHistoryLike>(base: H, fresh: H, windowSeconds: number): H {
  const from = fresh.now - windowSeconds;
  const mergeSeries = (old: any, add: any): any => {
    if (!old) {
      return add;
    }
    const last = old.t.length > 0 ? old.t[old.t.length - 1] : -Infinity;
    let start = 0;
    while (start < add.t.length && add.t[start] <= last + 1e-6) {
      start++;
    }
    const oldLength = old.t.length;
    for (const key of Object.keys(add)) {
      if (isPerGPU(add[key])) {
        const target = (old[key] = isPerGPU(old[key]) ? old[key] : {});
        for (const index of Object.keys(add[key])) {
          if (!target[index]) {
            target[index] = new Array(oldLength).fill(null);
          }
          target[index].push(...add[key][index].slice(start));
        }
      } else if (Array.isArray(add[key]) && Array.isArray(old[key])) {
        old[key].push(...add[key].slice(start));
      }
    }
    // A GPU index the kernel no longer holds memory on keeps its length with nulls.
    for (const key of Object.keys(old)) {
      if (isPerGPU(old[key])) {
        for (const index of Object.keys(old[key])) {
          const series = old[key][index];
          while (series.length < old.t.length) {
            series.push(null);
          }
        }
      }
    }
    return old;
  };
  const trim = (series: any): boolean => {
    let drop = 0;
    while (drop < series.t.length && series.t[drop] < from) {
      drop++;
    }
    if (drop > 0) {
      for (const key of Object.keys(series)) {
        if (isPerGPU(series[key])) {
          for (const index of Object.keys(series[key])) {
            series[key][index].splice(0, drop);
          }
        } else if (Array.isArray(series[key])) {
          series[key].splice(0, drop);
        }
      }
    }
    return series.t.length > 0;
  };
  for (const group of ['gpus', 'kernels'] as const) {
    const target = base[group] as { [key: string]: any };
    const add = fresh[group] as { [key: string]: any };
    for (const key of Object.keys(add)) {
      target[key] = mergeSeries(target[key], add[key]);
    }
    for (const key of Object.keys(target)) {
      if (!trim(target[key])) {
        delete target[key];
      }
    }
  }
  base.now = fresh.now;
  base.interval = fresh.interval;
  return base;
}
