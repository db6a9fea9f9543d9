/**
 * Typed client of the jupyter-gpushare REST API (`{baseUrl}api/gpushare/`).
 *
 * Requests go through `ServerConnection.makeRequest`, which adds the token and XSRF headers
 * the server expects. Errors carry the server's `message` so the panel can show it inline.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export type KernelState =
  'active' | 'idle' | 'releasing' | 'released' | 'restoring' | 'failed' | 'untracked';

export type Method = 'simulated' | 'driver' | 'framework' | 'off';

export interface IGPU {
  index: number;
  uuid: string | null;
  name: string | null;
  memory_total: number | null;
  memory_used: number | null;
  utilization: number | null;
  released_bytes: number | null;
}

export interface IKernel {
  id: string;
  name: string | null;
  path: string | null;
  pids: number[] | null;
  state: KernelState;
  pinned: boolean;
  gpu_memory_bytes: number | null;
  released_bytes: number | null;
  gpus: number[] | null;
  sm_utilization: number | null;
  idle_seconds: number | null;
  release_in_seconds: number | null;
  method: Method | string | null;
  releases: number | null;
  restores: number | null;
  last_restore_seconds: number | null;
  error: string | null;
  waiting: string | null;
}

export interface IStatus {
  backend: 'simulated' | 'nvml' | string;
  method: Method | string | null;
  available: boolean;
  reason: string | null;
  idle_timeout: number | null;
  gpus: IGPU[];
  kernels: IKernel[];
}

/** One time series; `t` is epoch seconds, the other arrays are aligned with it. */
export interface IGPUHistory {
  t: number[];
  memory_used: (number | null)[];
  utilization: (number | null)[];
}

export interface IKernelHistory {
  t: number[];
  gpu_memory_bytes: (number | null)[];
  sm_utilization: (number | null)[];
  /** Bytes held on each GPU index, aligned with `t`. */
  gpu: { [index: string]: (number | null)[] };
}

export interface IHistory {
  now: number;
  interval: number;
  gpus: { [index: string]: IGPUHistory };
  kernels: { [kernelId: string]: IKernelHistory };
}

/** An API error with the server's message (jupyter_server writes `{"message": ...}`). */
export class APIError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
    this.name = 'APIError';
  }
}

/** The REST client; one instance per application. */
export class GPUShareAPI {
  constructor(settings?: ServerConnection.ISettings) {
    this.serverSettings = settings ?? ServerConnection.makeSettings();
  }

  readonly serverSettings: ServerConnection.ISettings;

  status(): Promise<IStatus> {
    return this._request<IStatus>('status');
  }

  history(seconds: number): Promise<IHistory> {
    return this._request<IHistory>(`history?seconds=${Math.max(1, Math.round(seconds))}`);
  }

  release(kernelId: string): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/release`, {
      method: 'POST'
    });
  }

  restore(kernelId: string): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/restore`, {
      method: 'POST'
    });
  }

  pin(kernelId: string, pinned: boolean): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/pin`, {
      method: 'PUT',
      body: JSON.stringify({ pinned })
    });
  }

  private async _request<T>(endpoint: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this.serverSettings.baseUrl, 'api', 'gpushare', endpoint);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(url, init, this.serverSettings);
    } catch (error) {
      throw new ServerConnection.NetworkError(error as TypeError);
    }
    const text = await response.text();
    let data: any = null;
    if (text.length > 0) {
      try {
        data = JSON.parse(text);
      } catch {
        data = text;
      }
    }
    if (!response.ok) {
      const message =
        (data && typeof data === 'object' && (data.message || data.reason)) ||
        (typeof data === 'string' && data.length < 300 ? data : '') ||
        response.statusText ||
        `HTTP ${response.status}`;
      throw new APIError(String(message), response.status);
    }
    return data as T;
  }
}
