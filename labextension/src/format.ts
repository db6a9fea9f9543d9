/**
 * Pure formatting helpers (no DOM) shared by the panel, the status bar and notifications.
 */

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

/** Seconds as a compact duration: "45 s", "2 min 10 s", "1 h 5 min", "—" when unknown. */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '—';
  }
  const s = Math.max(0, seconds);
  if (s < 10) {
    return `${s.toFixed(1)} s`;
  }
  if (s < 60) {
    return `${Math.round(s)} s`;
  }
  if (s < 3600) {
    const m = Math.floor(s / 60);
    const rest = Math.round(s - m * 60);
    return rest > 0 ? `${m} min ${rest} s` : `${m} min`;
  }
  const h = Math.floor(s / 3600);
  const m = Math.round((s - h * 3600) / 60);
  return m > 0 ? `${h} h ${m} min` : `${h} h`;
}

/** Byte-seconds as GiB-hours with enough digits for small windows: "0.012 GiB·h". */
export function formatGiBHours(byteSeconds: number): string {
  const value = byteSeconds / GiB / 3600;
  const digits = value >= 10 ? 1 : value >= 1 ? 2 : 3;
  return `${value.toFixed(digits)} GiB·h`;
}

/** The file name of a notebook path ("dir/a.ipynb" -> "a.ipynb"). */
export function baseName(path: string | null | undefined): string {
  if (!path) {
    return '';
  }
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}
