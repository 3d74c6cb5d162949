// Schedules, inspects and cancels a task through the dispatcher with fetch only
// (see ../README.md).
const [base, token, queueName] = process.argv.slice(2);
if (!queueName) {
  console.error("usage: node client.mjs <base url> <token> <queue>");
  process.exit(2);
}
const queue = encodeURIComponent(queueName);

async function call(method, path, body) {
  const response = await fetch(base + path, {
    method,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(10_000),
  });
  return [response.status, await response.json()];
}

function expect(ok, what, value) {
  if (!ok) {
    console.error(`${what}: ${JSON.stringify(value)}`);
    process.exit(1);
  }
}

const due = new Date(Date.now() + 3_600_000).toISOString();
const task = { task_type: "bill.charge", payload: { order: 7 }, schedule_time: due };
const [status, posted] = await call("POST", `/tasks?queue=${queue}`, task);
expect(status === 201 && posted.state === "scheduled", "post", [status, posted]);
const id = posted.task_id;
let [, state] = await call("GET", `/tasks/${id}`);
expect(state.state === "scheduled", "state", state);
const [delayedStatus, delayed] = await call("GET", `/delayed/${queue}/${id}`);
expect(delayedStatus === 200 && delayed.envelope?.payload?.order === 7, "delayed", delayed);
const [, cancelled] = await call("POST", `/tasks/${id}/cancel`);
expect(cancelled.outcome === "removed", "cancel", cancelled);
[, state] = await call("GET", `/tasks/${id}`);
expect(state.state === "cancelled", "state after cancel", state);

const [refusedStatus, refused] = await call("POST", `/tasks?queue=${queue}`,
  { ...task, schedule_time: "2030-01-01T10:00:00" });
const first = refused.violations?.[0] ?? {};
expect(refusedStatus === 422 && first.rule === "timezone_required" && first.field === "schedule_time",
  "naive time", [refusedStatus, refused]);
console.log(id);
