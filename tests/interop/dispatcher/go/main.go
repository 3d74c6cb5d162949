// Command dispatcherclient schedules, inspects and cancels a task through the
// dispatcher with net/http only (see ../README.md).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"time"
)

type client struct {
	base  string
	token string
	http  *http.Client
}

// call sends one request and decodes the JSON answer.
func (c *client) call(ctx context.Context, method, path string, body any) (int, map[string]any, error) {
	var reader io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		reader = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, reader)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	var answer map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		return resp.StatusCode, nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	return resp.StatusCode, answer, nil
}

func expect(ok bool, format string, args ...any) {
	if !ok {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
		os.Exit(1)
	}
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: dispatcherclient <base url> <token> <queue>")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := &client{base: os.Args[1], token: os.Args[2], http: &http.Client{Timeout: 10 * time.Second}}
	queue := url.QueryEscape(os.Args[3])
	due := time.Now().Add(time.Hour).Format(time.RFC3339)
	task := map[string]any{"task_type": "bill.charge", "payload": map[string]any{"order": 7}, "schedule_time": due}

	status, posted, err := c.call(ctx, http.MethodPost, "/tasks?queue="+queue, task)
	expect(err == nil && status == 201 && posted["state"] == "scheduled", "post: %d %v %v", status, posted, err)
	id := posted["task_id"].(string)
	_, state, err := c.call(ctx, http.MethodGet, "/tasks/"+id, nil)
	expect(err == nil && state["state"] == "scheduled", "state: %v %v", state, err)
	status, delayed, err := c.call(ctx, http.MethodGet, "/delayed/"+queue+"/"+id, nil)
	envelope, _ := delayed["envelope"].(map[string]any)
	payload, _ := envelope["payload"].(map[string]any)
	expect(err == nil && status == 200 && payload["order"] == 7.0, "delayed: %d %v %v", status, delayed, err)
	_, cancelled, err := c.call(ctx, http.MethodPost, "/tasks/"+id+"/cancel", nil)
	expect(err == nil && cancelled["outcome"] == "removed", "cancel: %v %v", cancelled, err)
	_, state, err = c.call(ctx, http.MethodGet, "/tasks/"+id, nil)
	expect(err == nil && state["state"] == "cancelled", "state after cancel: %v %v", state, err)

	task["schedule_time"] = "2030-01-01T10:00:00"
	status, refused, err := c.call(ctx, http.MethodPost, "/tasks?queue="+queue, task)
	violations, _ := refused["violations"].([]any)
	first, _ := violations[0].(map[string]any)
	expect(err == nil && status == 422 && first["rule"] == "timezone_required" && first["field"] == "schedule_time",
		"naive time: %d %v %v", status, refused, err)
	fmt.Println(id)
}
