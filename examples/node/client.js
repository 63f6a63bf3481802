#!/usr/bin/env node
// A Node.js client of the Tandem engine, built from the .proto alone (loaded at run time).
//
//   node client.js [--address HOST:PORT] [--json] [--tls-ca F [--tls-cert F --tls-key F]] \
//        info | generate --prompt 1,2,3 [...] | abort --prompt 1,2,3 [--after N] [...] \
//        | embed --prompt 1,2,3 [--dimensions N] [--no-normalize]
//
// Field names are the proto's own (keepCase), enums are their names ("FINISH_REASON_ABORT").
// With --json every event is one JSON object per line on stdout, errors included; the exit
// status is 0 on success, 1 when an RPC fails (gRPC status code and message printed), 2 on a
// usage error, 130 when Ctrl-C cancelled a stream.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const PROTO_FILE = "tandem/engine/v1/engine.proto";

const USAGE = `usage: node client.js [options] <command> [command options]

commands:
  info                      GetModelInfo: model name, limits, vocab size, EOS ids, KV capacity
  generate                  Generate: stream the sampled token ids as they come
  abort                     Generate, then Abort it by request id after --after tokens
  embed                     Generate with pooling_params (task EMBED): the prompt's embedding

options:
  --address HOST:PORT       engine address (default 127.0.0.1:50051, or $TANDEM_ENGINE_ADDRESS)
  --json                    one JSON object per line on stdout (for scripts and tests)
  --timeout SECONDS         deadline of each call (default: 30 for info, none for streams)
  --tls-ca FILE             use TLS, trusting this CA bundle (PEM)
  --tls-cert FILE           client certificate for mutual TLS (PEM, with --tls-key)
  --tls-key FILE            client private key for mutual TLS (PEM, with --tls-cert)
  -h, --help                show this help

generate / abort options:
  --prompt IDS              prompt token ids, comma-separated (required; no tokenizer here)
  --max-tokens N            tokens to generate (generate: unset = rest of the context;
                            abort: default 1000)
  --temperature T           0 = greedy; unset = engine default (1.0)
                            (negative values as --flag=-1, e.g. --temperature=-1)
  --top-p P  --top-k K  --min-p P  --seed S
  --stop-token-ids IDS      comma-separated ids that end the request
  --ignore-eos              keep generating past EOS
  --request-id ID           client-chosen request id (default: the engine assigns one)
  --after N                 abort only: tokens to receive before calling Abort (default 4)

embed options:
  --prompt IDS              prompt token ids, comma-separated (required)
  --dimensions N            keep the first N values (Matryoshka models only)
  --no-normalize            the pooled hidden state as is (default: L2-normalized)
  --request-id ID           client-chosen request id (default: the engine assigns one)

Ctrl-C during a stream cancels the call, which aborts the request in the engine.`;

class UsageError extends Error {}
class Interrupted extends Error {}

function loadEngineService() {
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // snake_case field names, exactly as in the .proto
    longs: Number, // uint64 / int64 as JS numbers (the engine's counts fit easily)
    enums: String, // enum values by name
    defaults: true, // unset scalars read as their proto3 default ...
    oneofs: true, // ... but proto3 `optional` fields stay absent when unset
  });
  return grpc.loadPackageDefinition(definition).tandem.engine.v1.Engine;
}

function channelCredentials(opts) {
  if (!opts["tls-ca"] && !opts["tls-cert"] && !opts["tls-key"]) {
    return grpc.credentials.createInsecure();
  }
  if (Boolean(opts["tls-cert"]) !== Boolean(opts["tls-key"])) {
    throw new UsageError("--tls-cert and --tls-key go together");
  }
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(
    read(opts["tls-ca"]),
    read(opts["tls-key"]),
    read(opts["tls-cert"]),
  );
}

// ---------------------------------------------------------------------------- parsing flags

function parseIds(text, flag) {
  const ids = String(text)
    .split(/[\s,]+/)
    .filter((s) => s.length > 0)
    .map((s) => {
      if (!/^\d+$/.test(s)) throw new UsageError(`${flag}: "${s}" is not a token id`);
      return Number(s);
    });
  return ids;
}

function parseNumber(text, flag, { integer = false } = {}) {
  const value = Number(text);
  if (text === undefined || text === "" || Number.isNaN(value)) {
    throw new UsageError(`${flag}: "${text}" is not a number`);
  }
  if (integer && !Number.isInteger(value)) {
    throw new UsageError(`${flag}: "${text}" is not an integer`);
  }
  return value;
}

// The GenerateRequest for generate / abort. Only flags given on the command line are set, so an
// unset `optional` field selects the engine's default (temperature 0 is not "unset").
function generateRequest(opts, defaultMaxTokens) {
  if (opts.prompt === undefined) throw new UsageError("--prompt is required");
  const params = {};
  const maxTokens = opts["max-tokens"] ?? defaultMaxTokens;
  if (maxTokens !== undefined) {
    params.max_tokens = parseNumber(maxTokens, "--max-tokens", { integer: true });
  }
  if (opts.temperature !== undefined) {
    params.temperature = parseNumber(opts.temperature, "--temperature");
  }
  if (opts["top-p"] !== undefined) params.top_p = parseNumber(opts["top-p"], "--top-p");
  if (opts["top-k"] !== undefined) {
    params.top_k = parseNumber(opts["top-k"], "--top-k", { integer: true });
  }
  if (opts["min-p"] !== undefined) params.min_p = parseNumber(opts["min-p"], "--min-p");
  if (opts.seed !== undefined) params.seed = parseNumber(opts.seed, "--seed", { integer: true });
  if (opts["stop-token-ids"] !== undefined) {
    params.stop_token_ids = parseIds(opts["stop-token-ids"], "--stop-token-ids");
  }
  if (opts["ignore-eos"]) params.ignore_eos = true;
  return {
    request: {
      request_id: opts["request-id"] ?? "", // empty: the engine assigns one
      prompt_token_ids: parseIds(opts.prompt, "--prompt"),
      sampling_params: params,
    },
  };
}

// The GenerateRequest for embed: a pooling request (pooling_params set, sampling_params unset).
function embedRequest(opts) {
  if (opts.prompt === undefined) throw new UsageError("--prompt is required");
  const params = { task: "POOLING_TASK_EMBED" };
  if (opts.dimensions !== undefined) {
    params.dimensions = parseNumber(opts.dimensions, "--dimensions", { integer: true });
  }
  if (opts["no-normalize"]) params.normalize = false;
  return {
    request: {
      request_id: opts["request-id"] ?? "",
      prompt_token_ids: parseIds(opts.prompt, "--prompt"),
      pooling_params: params,
    },
  };
}

function deadline(opts, fallbackSeconds) {
  const seconds =
    opts.timeout !== undefined ? parseNumber(opts.timeout, "--timeout") : fallbackSeconds;
  return seconds === undefined ? {} : { deadline: Date.now() + seconds * 1000 };
}

// ---------------------------------------------------------------------------- output

class Printer {
  constructor(json) {
    this.json = json;
    this.midLine = false;
    this.start = process.hrtime.bigint();
  }

  // Milliseconds since the client started, so a reader can see tokens arrive over time.
  elapsedMs() {
    return Number(process.hrtime.bigint() - this.start) / 1e6;
  }

  // One event: a JSON line, or in text mode `text` (token ids run on together on one line;
  // any other text starts on a fresh line).
  event(name, fields, text, { inline = false } = {}) {
    if (this.json) {
      const line = { event: name, ...fields, t_ms: Math.round(this.elapsedMs() * 10) / 10 };
      process.stdout.write(JSON.stringify(line) + "\n");
    } else if (text !== undefined) {
      if (!inline) this.endLine();
      process.stdout.write(text);
      this.midLine = inline ? this.midLine || text.length > 0 : false;
    }
  }

  // A message for stderr, after ending a line of token ids so the two do not run together.
  warn(text) {
    this.endLine();
    process.stderr.write(text);
  }

  endLine() {
    if (this.midLine) process.stdout.write("\n");
    this.midLine = false;
  }
}

function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) ?? String(code);
}

// ---------------------------------------------------------------------------- commands

function unary(client, method, request, options) {
  return new Promise((resolve, reject) => {
    client[method](request, new grpc.Metadata(), options, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

async function info(client, opts, out) {
  const reply = await unary(client, "GetModelInfo", {}, deadline(opts, 30));
  const rows = [
    ["served_model_name", reply.served_model_name],
    ["max_model_len", reply.max_model_len],
    ["vocab_size", reply.vocab_size],
    ["eos_token_ids", JSON.stringify(reply.eos_token_ids)],
    ["bos_token_id", reply.bos_token_id ?? "(none)"],
    ["block_size", reply.block_size],
    ["num_kv_blocks", reply.num_kv_blocks],
    ["kv_capacity_tokens", reply.kv_capacity_tokens],
    ["max_logprobs", reply.max_logprobs],
    ["model_source", reply.model_source],
    ["engine_version", reply.engine_version],
    ["supported_tasks", JSON.stringify(reply.supported_tasks)],
    ["embedding_size", reply.embedding_size],
    ["pooling_type", reply.pooling_type || "(none)"],
    ["is_matryoshka", reply.is_matryoshka],
    ["labels", JSON.stringify(reply.labels)],
  ];
  const text = rows.map(([k, v]) => `${k.padEnd(20)} ${v}\n`).join("");
  // Drop protobufjs' synthetic oneof markers ("_bos_token_id") from the JSON line.
  const fields = Object.fromEntries(Object.entries(reply).filter(([k]) => !k.startsWith("_")));
  out.event("info", fields, text);
  return 0;
}

// Runs one Generate call, printing each response as it arrives. `onOutput(output, received)` is
// called after each response, with the number of tokens received so far; returns the summary.
async function streamGenerate(client, request, opts, out, onOutput) {
  const call = client.Generate(request, deadline(opts, undefined));
  let interrupted = false;
  const cancel = () => {
    interrupted = true;
    call.cancel(); // Ctrl-C: cancelling the call aborts the request in the engine
  };
  process.once("SIGINT", cancel);
  const tokens = [];
  let last = null;
  let promptTokens = 0; // an aborted request's final output is empty: keep the earlier figures
  let cachedTokens = 0;
  try {
    for await (const response of call) {
      const output = response.output;
      tokens.push(...output.new_token_ids);
      last = output;
      promptTokens = output.num_prompt_tokens || promptTokens;
      cachedTokens = output.num_cached_tokens || cachedTokens;
      out.event(
        "tokens",
        {
          request_id: output.request_id,
          new_token_ids: output.new_token_ids,
          finish_reason: output.finish_reason,
          load: response.load ?? null,
        },
        output.new_token_ids.map((id) => `${id} `).join(""),
        { inline: true },
      );
      if (onOutput) await onOutput(output, tokens.length);
    }
  } catch (err) {
    if (interrupted && err.code === grpc.status.CANCELLED) throw new Interrupted();
    throw err;
  } finally {
    process.removeListener("SIGINT", cancel);
  }
  const summary = {
    request_id: last ? last.request_id : "",
    token_ids: tokens,
    num_tokens: tokens.length,
    finish_reason: last ? last.finish_reason : "FINISH_REASON_UNSPECIFIED",
    num_prompt_tokens: promptTokens,
    num_cached_tokens: cachedTokens,
  };
  if (last && last.stop_reason !== undefined) summary.stop_reason = last.stop_reason;
  return summary;
}

async function generate(client, opts, out) {
  const request = generateRequest(opts, undefined);
  out.event("start", { request: request.request });
  const summary = await streamGenerate(client, request, opts, out, null);
  out.event(
    "done",
    summary,
    `${summary.num_tokens} tokens, ${summary.finish_reason}, request ${summary.request_id}\n`,
  );
  return 0;
}

async function abort(client, opts, out) {
  const request = generateRequest(opts, "1000");
  const after = opts.after === undefined ? 4 : parseNumber(opts.after, "--after", { integer: true });
  out.event("start", { request: request.request, abort_after: after });
  let sent = false;
  const summary = await streamGenerate(client, request, opts, out, async (output, received) => {
    if (sent || received < after || output.finish_reason !== "FINISH_REASON_UNSPECIFIED") return;
    sent = true;
    // Generate responses carry the request id, also when the engine assigned it.
    const reply = await unary(
      client,
      "Abort",
      { request_ids: [output.request_id] },
      deadline(opts, 30),
    );
    out.event(
      "abort_sent",
      { request_id: output.request_id, after_tokens: received, num_aborted: reply.num_aborted },
      `[Abort ${output.request_id} after ${received} tokens: ${reply.num_aborted} aborted]\n`,
    );
  });
  out.event(
    "done",
    summary,
    `${summary.num_tokens} tokens, ${summary.finish_reason}, request ${summary.request_id}\n`,
  );
  if (summary.finish_reason !== "FINISH_REASON_ABORT") {
    out.warn(`the request ended with ${summary.finish_reason}, not by the abort\n`);
    return 1;
  }
  return 0;
}

// A pooling request gets exactly one GenerateResponse: the final output, carrying `pooled`.
async function embed(client, opts, out) {
  const request = embedRequest(opts);
  out.event("start", { request: request.request });
  const call = client.Generate(request, deadline(opts, 60));
  let output = null;
  for await (const response of call) output = response.output;
  if (!output || !output.pooled) throw new Error("the engine sent no pooled result");
  const vector = output.pooled.data;
  const head = vector.slice(0, 8).map((x) => x.toFixed(6));
  out.event(
    "embedding",
    {
      request_id: output.request_id,
      dimensions: vector.length,
      embedding: vector,
      num_prompt_tokens: output.num_prompt_tokens,
      finish_reason: output.finish_reason,
    },
    `embedding of ${vector.length} values (request ${output.request_id}, ` +
      `${output.num_prompt_tokens} prompt tokens):\n` +
      `[${head.join(", ")}${vector.length > head.length ? ", ..." : ""}]\n`,
  );
  return 0;
}

const COMMANDS = { info, generate, abort, embed };

// ---------------------------------------------------------------------------- main

const OPTIONS = {
  address: { type: "string" },
  json: { type: "boolean" },
  timeout: { type: "string" },
  "tls-ca": { type: "string" },
  "tls-cert": { type: "string" },
  "tls-key": { type: "string" },
  help: { type: "boolean", short: "h" },
  prompt: { type: "string" },
  "max-tokens": { type: "string" },
  temperature: { type: "string" },
  "top-p": { type: "string" },
  "top-k": { type: "string" },
  "min-p": { type: "string" },
  seed: { type: "string" },
  "stop-token-ids": { type: "string" },
  "ignore-eos": { type: "boolean" },
  "request-id": { type: "string" },
  after: { type: "string" },
  dimensions: { type: "string" },
  "no-normalize": { type: "boolean" },
};

async function main(argv) {
  let opts;
  let command;
  try {
    const parsed = parseArgs({ args: argv, options: OPTIONS, allowPositionals: true });
    opts = parsed.values;
    if (opts.help) {
      process.stdout.write(USAGE + "\n");
      return 0;
    }
    if (parsed.positionals.length !== 1 || !(parsed.positionals[0] in COMMANDS)) {
      throw new UsageError("give exactly one command: info, generate, abort or embed");
    }
    command = parsed.positionals[0];
  } catch (err) {
    process.stderr.write(`error: ${err.message}\n(node client.js --help for usage)\n`);
    return 2;
  }

  const out = new Printer(Boolean(opts.json));
  const address = opts.address ?? process.env.TANDEM_ENGINE_ADDRESS ?? "127.0.0.1:50051";
  let client;
  try {
    const Engine = loadEngineService();
    client = new Engine(address, channelCredentials(opts));
    return await COMMANDS[command](client, opts, out);
  } catch (err) {
    if (err instanceof Interrupted) {
      out.event("cancelled", {}, "cancelled (the engine aborts the request)\n");
      return 130;
    }
    if (err instanceof UsageError) {
      out.warn(`error: ${err.message}\n`);
      return 2;
    }
    if (typeof err.code !== "number" || err.details === undefined) throw err; // not a gRPC error
    const name = statusName(err.code);
    out.event("error", { code: err.code, status: name, message: err.details });
    out.warn(`error: gRPC status ${name} (${err.code}): ${err.details}\n`);
    return 1;
  } finally {
    if (client) client.close();
  }
}

main(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code;
  },
  (err) => {
    process.stderr.write(`${err.stack ?? err}\n`);
    process.exitCode = 1;
  },
);
