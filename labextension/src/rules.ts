/**
 * Which actions a kernel's state allows (pure; mirrors the server's 409 rules so buttons are
 * disabled instead of failing). The states are the contract's (`KernelState`).
 */
import type { KernelState } from './api';

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
