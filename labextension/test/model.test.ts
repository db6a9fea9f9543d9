/**
 * The model follows the server at once after an action and on a server event, not one poll
 * later (issue 18: the panel said "active · release in 1 min 49 s" while the server said
 * `releasing`). A fake API answers when the test says so; the poll interval is a minute, so
 * every request seen here is a refresh the model asked for.
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';
import { Signal } from '@lumino/signaling';

import type { GPUShareAPI } from '../src/api';
import type { IKernel, IStatus } from '../src/contract';
import { GPUShareModel } from '../src/model';

interface IDeferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
}

function deferred<T>(): IDeferred<T> {
  let resolve!: (value: T) => void;
  const promise = new Promise<T>(r => (resolve = r));
  return { promise, resolve };
}

function kernel(state: IKernel['state']): IKernel {
  return { id: 'k', state, path: 'a.ipynb', pinned: false } as unknown as IKernel;
}

function status(state: IKernel['state']): IStatus {
  return { available: true, gpus: [], kernels: [kernel(state)] } as unknown as IStatus;
}

/** A fake API whose status and release requests wait for the test to answer them. */
class FakeAPI {
  statusCalls: IDeferred<IStatus>[] = [];
  releases: IDeferred<IKernel>[] = [];
  status(): Promise<IStatus> {
    const call = deferred<IStatus>();
    this.statusCalls.push(call);
    return call.promise;
  }
  release(): Promise<IKernel> {
    const call = deferred<IKernel>();
    this.releases.push(call);
    return call.promise;
  }
}

async function until(condition: () => boolean, what: string): Promise<void> {
  for (let i = 0; i < 200 && !condition(); i++) {
    await new Promise(r => setTimeout(r, 5));
  }
  assert.ok(condition(), `timed out waiting for ${what}`);
}

async function settle(): Promise<void> {
  await new Promise(r => setTimeout(r, 50));
}

function makeModel(api: FakeAPI): GPUShareModel {
  return new GPUShareModel({
    api: api as unknown as GPUShareAPI,
    refreshInterval: 60_000,
    historySeconds: 600
  });
}

test('a release shows as pending at once, and a status older than its answer does not undo it', async () => {
  const api = new FakeAPI();
  const model = makeModel(api);
  try {
    await until(() => api.statusCalls.length === 1, 'the first poll');
    api.statusCalls[0].resolve(status('active'));
    await until(() => model.kernel('k')?.state === 'active', 'the first status');

    let changes = 0;
    model.changed.connect(() => changes++);
    const done = model.release('k');
    assert.equal(model.pendingAction('k'), 'release');
    assert.ok(changes > 0, 'the view is told at once');

    // A refresh (a server event, say) leaves before the release's answer...
    void model.refresh();
    await until(() => api.statusCalls.length === 2, 'the refresh');
    api.releases[0].resolve(kernel('released'));
    await done;
    assert.equal(model.pendingAction('k'), null);
    assert.equal(model.kernel('k')?.state, 'released');
    // ...and comes back after it, with the state from before: it must not win.
    api.statusCalls[1].resolve(status('active'));
    await settle();
    assert.equal(model.kernel('k')?.state, 'released');
    // The model asks again at once rather than wait a poll interval (a minute here).
    await until(() => api.statusCalls.length === 3, 'a refresh after the action');
    api.statusCalls[2].resolve(status('released'));
    await settle();
    assert.equal(model.kernel('k')?.state, 'released');
  } finally {
    model.dispose();
  }
});

test('a refresh asked while a status request is on its way is not dropped', async () => {
  const api = new FakeAPI();
  const model = makeModel(api);
  try {
    await until(() => api.statusCalls.length === 1, 'the first poll');
    api.statusCalls[0].resolve(status('active'));
    await settle();
    void model.refresh();
    await until(() => api.statusCalls.length === 2, 'the first refresh');
    // Poll.refresh() alone does nothing while a refresh's request is in flight.
    void model.refresh();
    await settle();
    assert.equal(api.statusCalls.length, 2, 'one request at a time');
    api.statusCalls[1].resolve(status('releasing'));
    await until(() => api.statusCalls.length === 3, 'the refresh asked meanwhile');
    api.statusCalls[2].resolve(status('released'));
    await until(() => model.kernel('k')?.state === 'released', 'the newest status');
  } finally {
    model.dispose();
  }
});

test("the model refreshes on the server's gpushare events and only those", async () => {
  const api = new FakeAPI();
  const model = makeModel(api);
  const stream = new Signal<unknown, { schema_id: string }>({});
  const schema = 'https://events.jupyter.org/jupyter_gpushare/kernel/v1';
  const connection = model.followEvents(stream, schema);
  try {
    await until(() => api.statusCalls.length === 1, 'the first poll');
    api.statusCalls[0].resolve(status('active'));
    await settle();
    stream.emit({ schema_id: 'https://events.jupyter.org/jupyter_server/contents_service/v1' });
    await settle();
    assert.equal(api.statusCalls.length, 1, 'another schema: no refresh');
    stream.emit({ schema_id: schema });
    await until(() => api.statusCalls.length === 2, 'a refresh on the event');
    api.statusCalls[1].resolve(status('released'));
    await until(() => model.kernel('k')?.state === 'released', 'the new status');
    connection.dispose();
    stream.emit({ schema_id: schema });
    await settle();
    assert.equal(api.statusCalls.length, 2, 'disconnected');
  } finally {
    model.dispose();
  }
});

test('while a kernel is releasing or restoring, the model refreshes until it is done', async () => {
  const api = new FakeAPI();
  const model = makeModel(api);
  try {
    await until(() => api.statusCalls.length === 1, 'the first poll');
    // The server's "restored" event can come while its status still says "restoring".
    api.statusCalls[0].resolve(status('restoring'));
    await until(() => api.statusCalls.length === 2, 'a follow-up refresh');
    api.statusCalls[1].resolve(status('releasing'));
    await until(() => api.statusCalls.length === 3, 'another follow-up refresh');
    api.statusCalls[2].resolve(status('released'));
    await until(() => model.kernel('k')?.state === 'released', 'the end state');
    await new Promise(r => setTimeout(r, 1200));
    assert.equal(api.statusCalls.length, 3, 'no more refreshes once nothing moves');
  } finally {
    model.dispose();
  }
});
