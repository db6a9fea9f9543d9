/**
 * Unit tests of the toasts' text (src/toasts.ts): what a person reads when a kernel is
 * released or restored. Run with `jlpm test`.
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import { IKernelEvent } from '../src/contract';
import { describeEvent } from '../src/toasts';

const GiB = 1024 ** 3;
const released: IKernelEvent = {
  kernel_id: 'k1',
  action: 'released',
  bytes: GiB,
  reason: 'idle for 612 s, idle_timeout 600 s'
};

test('a release says what brings the memory back, and that %gpushare alone does not', () => {
  const eager = describeEvent(released, 'a.ipynb', 'eager');
  assert.equal(
    eager?.message,
    'Released 1.0 GiB GPU memory of a.ipynb to host memory; it comes back before the next ' +
      'cell (idle for 612 s, idle_timeout 600 s) (a cell of only %gpushare magics leaves it released).'
  );
  assert.equal(eager?.type, 'info');
  const lazy = describeEvent(released, 'a.ipynb', 'lazy');
  assert.match(lazy?.message ?? '', /before the next GPU cell/);
  // what matters fits in the 140 characters the lab shows
  assert.ok((eager?.message ?? '').indexOf('before the next cell') < 140);
});

test('a restore ahead of the person is the only activity event that toasts', () => {
  const waiting: IKernelEvent = { kernel_id: 'k1', action: 'restore_waiting', trigger: 'activity' };
  assert.equal(describeEvent(waiting, 'a.ipynb'), null);
  const ahead: IKernelEvent = {
    kernel_id: 'k1',
    action: 'restored',
    bytes: GiB,
    seconds: 0.5,
    reason: 'activity',
    trigger: 'activity'
  };
  assert.match(describeEvent(ahead, 'a.ipynb')?.message ?? '', /ahead of your next cell\.$/);
});

test('failures are errors that name the reason', () => {
  const failed: IKernelEvent = {
    kernel_id: 'k1',
    action: 'restore_failed',
    reason: 'out of memory'
  };
  assert.deepEqual(describeEvent(failed, 'a.ipynb'), {
    type: 'error',
    message: 'Could not restore the GPU memory of a.ipynb (out of memory).'
  });
});
