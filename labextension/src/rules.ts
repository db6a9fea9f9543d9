/**
 * Which actions a kernel's state allows (pure; mirrors the server's 409 rules so buttons are
 * disabled instead of failing). The states are the contract's (`KernelState`).
 */
import type { IKernel, KernelState } from './contract';
import { distinctNames } from './format';

export interface IAllowed {
  release: boolean;
  restore: boolean;
  pin: boolean;
}

/**
 * Pinning is not part of it: a pinned kernel is never released *automatically*, and a person
 * may still release it by hand, as over REST and with `%gpushare release`.
 */
export function allowedActions(state: KernelState): IAllowed {
  return {
    // Only a resident kernel has GPU memory to release.
    release: state === 'active' || state === 'idle',
    // `failed` keeps the held state, so a restore can be retried.
    restore: state === 'released' || state === 'failed',
    pin: state !== 'untracked'
  };
}

/** A categorical palette readable on light and dark themes (Tableau 10). */
export const PALETTE = [
  '#4e79a7',
  '#f28e2b',
  '#59a14f',
  '#e15759',
  '#76b7b2',
  '#edc948',
  '#b07aa1',
  '#ff9da7',
  '#9c755f',
  '#bab0ac'
];

/** Stable colors: a kernel keeps its color for as long as the page lives. */
export class ColorMap {
  color(id: string): string {
    let color = this._colors.get(id);
    if (color === undefined) {
      color = PALETTE[this._next % PALETTE.length];
      this._next++;
      this._colors.set(id, color);
    }
    return color;
  }

  private _colors = new Map<string, string>();
  private _next = 0;
}

/**
 * The name of each kernel's row: its notebook's file name with as many parent folders as it
 * takes to differ from the other kernels' notebooks; the kernelspec and the id's first
 * characters for a kernel without a notebook, or for two kernels on one notebook.
 */
export function kernelLabels(
  kernels: readonly Pick<IKernel, 'id' | 'name' | 'path'>[]
): Map<string, string> {
  const names = distinctNames(kernels.map(k => k.path).filter(p => p));
  const perPath = new Map<string, number>();
  kernels.forEach(k => perPath.set(k.path, (perPath.get(k.path) ?? 0) + 1));
  const labels = new Map<string, string>();
  for (const k of kernels) {
    const short = k.id.slice(0, 8);
    if (!k.path) {
      labels.set(k.id, k.name ? `${k.name} ${short}` : `kernel ${short}`);
    } else {
      const name = names.get(k.path) ?? k.path;
      labels.set(k.id, perPath.get(k.path)! > 1 ? `${name} (${short})` : name);
    }
  }
  return labels;
}

/** What a request the panel sent for a kernel is doing, while it is in flight. */
export type PendingAction = 'release' | 'restore' | 'pin';

/**
 * The state a kernel's row shows: the server's, except while a release or restore asked from
 * this page is in flight, when it shows "releasing"/"restoring" at once rather than the state
 * before the click until the request returns (and "release in 1 min 49 s" meanwhile).
 */
export function displayedState(state: KernelState, pending: PendingAction | null): KernelState {
  if (pending === 'release' && (state === 'active' || state === 'idle')) {
    return 'releasing';
  }
  if (pending === 'restore' && (state === 'released' || state === 'failed')) {
    return 'restoring';
  }
  return state;
}

const collator = new Intl.Collator(undefined, { sensitivity: 'base', numeric: true });

/**
 * Kernel ids in row order: by notebook path as a person sorts names (case-insensitive,
 * "run2" before "run10"), then exactly (so "A.ipynb" and "a.ipynb" keep one order), then by
 * id. Stable between refreshes. Kernels without a notebook come last.
 */
export function sortKernels(kernels: readonly Pick<IKernel, 'id' | 'path'>[]): string[] {
  const exact = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);
  return [...kernels]
    .sort((a, b) => {
      const pa = a.path ?? '';
      const pb = b.path ?? '';
      if (!pa !== !pb) {
        return pa ? -1 : 1;
      }
      return collator.compare(pa, pb) || exact(pa, pb) || exact(a.id, b.id);
    })
    .map(k => k.id);
}
