/**
 * Restores ahead of a person's next cell: which kernels are asked for, and how often.
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import {
  AHEAD_INTERVAL_MS,
  AHEAD_TEXT,
  aheadEligible,
  AheadRestorer,
  backAtNotebook,
  isAheadText
} from '../src/ahead';
import type { IKernel } from '../src/contract';

function kernel(id: string, state: IKernel['state'], more: Partial<IKernel> = {}): IKernel {
  return { id, state, path: `${id}.ipynb`, pinned: false, waiting: null, ...more } as IKernel;
}

function restorer(kernels: IKernel[]) {
  const sent: string[] = [];
  let now = 1_000_000;
  const r = new AheadRestorer({
    kernel: id => kernels.find(k => k.id === id),
    send: id => {
      sent.push(id);
      return Promise.resolve();
    },
    now: () => now
  });
  return { r, sent, advance: (ms: number) => (now += ms) };
}

test('only a released kernel, not pinned, not already on its way back, is asked for', () => {
  assert.equal(aheadEligible(kernel('a', 'released')), true);
  assert.equal(aheadEligible(kernel('a', 'released', { pinned: true })), false);
  assert.equal(aheadEligible(kernel('a', 'released', { waiting: AHEAD_TEXT })), false);
  assert.equal(aheadEligible(kernel('a', 'released', { waiting: 'waiting for memory: x' })), false);
  for (const state of [
    'active',
    'idle',
    'releasing',
    'restoring',
    'failed',
    'untracked'
  ] as const) {
    assert.equal(aheadEligible(kernel('a', state)), false, state);
  }
  assert.equal(aheadEligible(undefined), false); // not known yet (page load): no request
});

test('one request per kernel per interval, however much the person types', () => {
  const { r, sent, advance } = restorer([kernel('a', 'released'), kernel('b', 'released')]);
  assert.equal(r.activity('a'), true);
  for (let i = 0; i < 50; i++) {
    advance(50);
    r.activity('a');
  }
  assert.deepEqual(sent, ['a']);
  assert.equal(r.activity('b'), true); // another kernel has its own interval
  advance(AHEAD_INTERVAL_MS);
  assert.equal(r.activity('a'), true);
  assert.deepEqual(sent, ['a', 'b', 'a']);
});

test('no request without a kernel, for an unknown one, or a resident one', () => {
  const { r, sent } = restorer([kernel('a', 'active'), kernel('p', 'released', { pinned: true })]);
  assert.equal(r.activity(null), false);
  assert.equal(r.activity(undefined), false);
  assert.equal(r.activity('nope'), false);
  assert.equal(r.activity('a'), false);
  assert.equal(r.activity('p'), false);
  assert.deepEqual(sent, []);
});

test('an ineligible moment does not start the interval; forget clears it', () => {
  const kernels = [kernel('a', 'active')];
  const { r, sent } = restorer(kernels);
  assert.equal(r.activity('a'), false);
  kernels[0] = kernel('a', 'released');
  assert.equal(r.activity('a'), true);
  r.forget('a');
  assert.equal(r.activity('a'), true);
  assert.deepEqual(sent, ['a', 'a']);
});

test('a failed request is logged, not thrown', async () => {
  const warn = console.warn;
  const warned: unknown[] = [];
  console.warn = (...args: unknown[]) => warned.push(args);
  try {
    const r = new AheadRestorer({
      kernel: () => kernel('a', 'released'),
      send: () => Promise.reject(new Error('offline'))
    });
    assert.equal(r.activity('a'), true);
    await new Promise(resolve => setTimeout(resolve, 10));
    assert.equal(warned.length, 1);
  } finally {
    console.warn = warn;
  }
});

test('the text of a restore ahead is told from a wait for memory', () => {
  assert.equal(isAheadText(`${AHEAD_TEXT}; waiting for memory: x`), true);
  assert.equal(isAheadText('waiting for memory: x'), false);
  assert.equal(isAheadText(null), false);
});

test('back at the page: shown again or focused, with a notebook in front', () => {
  assert.equal(backAtNotebook('visibilitychange', 'visible', true), true);
  assert.equal(backAtNotebook('focus', 'visible', true), true);
  // the tab hidden (a person leaving) is not coming back
  assert.equal(backAtNotebook('visibilitychange', 'hidden', true), false);
  // a terminal, an editor or the launcher in front: its notebook is not what they came to
  assert.equal(backAtNotebook('visibilitychange', 'visible', false), false);
  assert.equal(backAtNotebook('focus', 'visible', false), false);
  assert.equal(backAtNotebook('blur', 'visible', true), false);
});
