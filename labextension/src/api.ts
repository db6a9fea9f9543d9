/**
 * Typed client of the jupyter-gpushare REST API (`{baseUrl}api/gpushare/`).
 *
 * Requests go through `ServerConnection.makeRequest`, which adds the token and XSRF headers
 * the server expects. Errors carry the server's `message` so the panel can show it inline.
 * The shapes it returns are those of the REST contract, `jupyter_gpushare/server/openapi.yaml`.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

// The JSON shapes are generated from the contract (jupyter_gpushare/server/openapi.yaml).
import type { IHistory, IKernel, IPinRequest, IStatus } from './contract';
export * from './contract';

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

/** The optional body of a release or restore asked from the panel. */
const PANEL_ACTION = JSON.stringify({ trigger: 'panel' });
/** The body of a restore ahead of a person's next cell. */
const ACTIVITY_ACTION = JSON.stringify({ trigger: 'activity' });

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

  // The body says the request comes from the panel (openapi.yaml, requestBodies/Action): the
  // event's reason, and so the toast, then reads as the person's own action.
  release(kernelId: string): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/release`, {
      method: 'POST',
      body: PANEL_ACTION
    });
  }

  restore(kernelId: string): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/restore`, {
      method: 'POST',
      body: PANEL_ACTION
    });
  }

  /** A person works in the kernel's notebook: restore it ahead of their next cell (answered
   * at once; the restore goes on in the background). */
  restoreAhead(kernelId: string): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/restore`, {
      method: 'POST',
      body: ACTIVITY_ACTION
    });
  }

  pin(kernelId: string, pinned: boolean): Promise<IKernel> {
    return this._request<IKernel>(`kernels/${encodeURIComponent(kernelId)}/pin`, {
      method: 'PUT',
      body: JSON.stringify({ pinned } satisfies IPinRequest)
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
