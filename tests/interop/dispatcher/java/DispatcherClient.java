import java.net.URI;
import java.net.URLEncoder;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.time.temporal.ChronoUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Schedules, inspects and cancels a task through the dispatcher with java.net.http only
 * (see ../README.md). Run as a single source file: {@code java DispatcherClient.java ...}.
 * The JDK has no JSON parser, so answers are read with patterns for the few fields checked.
 */
public final class DispatcherClient {
    private final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
    private final String base;
    private final String token;

    private DispatcherClient(String base, String token) {
        this.base = base;
        this.token = token;
    }

    private HttpResponse<String> call(String method, String path, String body) throws Exception {
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + path))
                .timeout(Duration.ofSeconds(10))
                .header("Authorization", "Bearer " + token)
                .header("Content-Type", "application/json")
                .method(method, body == null ? HttpRequest.BodyPublishers.noBody()
                        : HttpRequest.BodyPublishers.ofString(body));
        return http.send(request.build(), HttpResponse.BodyHandlers.ofString());
    }

    private static String field(String json, String name) {
        Matcher found = Pattern.compile("\"" + name + "\":\\s*(\"([^\"]*)\"|[0-9]+)").matcher(json);
        if (!found.find()) {
            return null;
        }
        return found.group(2) != null ? found.group(2) : found.group(1);
    }

    private static void expect(boolean ok, String what, HttpResponse<String> response) {
        if (!ok) {
            System.err.println(what + ": " + response.statusCode() + " " + response.body());
            System.exit(1);
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: java DispatcherClient.java <base url> <token> <queue>");
            System.exit(2);
        }
        DispatcherClient client = new DispatcherClient(args[0], args[1]);
        String queue = URLEncoder.encode(args[2], StandardCharsets.UTF_8);
        String due = Instant.now().plus(1, ChronoUnit.HOURS).truncatedTo(ChronoUnit.SECONDS).toString();
        String task = "{\"task_type\": \"bill.charge\", \"payload\": {\"order\": 7}, \"schedule_time\": \"%s\"}";

        HttpResponse<String> posted = client.call("POST", "/tasks?queue=" + queue, String.format(task, due));
        expect(posted.statusCode() == 201 && "scheduled".equals(field(posted.body(), "state")), "post", posted);
        String id = field(posted.body(), "task_id");
        HttpResponse<String> state = client.call("GET", "/tasks/" + id, null);
        expect("scheduled".equals(field(state.body(), "state")), "state", state);
        HttpResponse<String> delayed = client.call("GET", "/delayed/" + queue + "/" + id, null);
        expect(delayed.statusCode() == 200 && "7".equals(field(delayed.body(), "order")), "delayed", delayed);
        HttpResponse<String> cancelled = client.call("POST", "/tasks/" + id + "/cancel", null);
        expect("removed".equals(field(cancelled.body(), "outcome")), "cancel", cancelled);
        state = client.call("GET", "/tasks/" + id, null);
        expect("cancelled".equals(field(state.body(), "state")), "state after cancel", state);

        HttpResponse<String> refused = client.call("POST", "/tasks?queue=" + queue,
                String.format(task, "2030-01-01T10:00:00"));
        expect(refused.statusCode() == 422 && "timezone_required".equals(field(refused.body(), "rule"))
                && "schedule_time".equals(field(refused.body(), "field")), "naive time", refused);
        System.out.println(id);
    }
}
