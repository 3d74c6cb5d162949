// Build the CommonJS entry and the TypeScript declarations from src/ (ESM, the source).
//
//   dist/index.cjs     one CommonJS file bundled by esbuild; ioredis stays a require()
//   dist/types/*.d.ts  declarations generated from the JSDoc of src/ by tsc
//
// dist/index.cjs sits one level below the package root like src/, so both find the
// Lua scripts in ../lua/. Run by `npm run build` and by `prepare` (npm install / npm ci).

import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = fileURLToPath(new URL('..', import.meta.url));
const require = createRequire(import.meta.url);
const dist = path.join(root, 'dist');

fs.rmSync(dist, { recursive: true, force: true });

const esbuild = require('esbuild');
esbuild.buildSync({
  entryPoints: [path.join(root, 'src', 'index.js')],
  outfile: path.join(dist, 'index.cjs'),
  bundle: true,
  platform: 'node',
  target: 'node20',
  format: 'cjs',
  packages: 'external',
  // import.meta.url of the ESM source is the bundle's own file URL.
  banner: { js: "const __import_meta_url = require('node:url').pathToFileURL(__filename).href;" },
  define: { 'import.meta.url': '__import_meta_url' },
  logLevel: 'warning',
});

const tsc = require.resolve('typescript/bin/tsc');
execFileSync(process.execPath, [tsc, '-p', path.join(root, 'tsconfig.json')], { stdio: 'inherit', cwd: root });
console.log('built dist/index.cjs and dist/types/');
