package io.kombuenvelope;

import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.codec.StringCodec;

import java.net.SocketAddress;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.CompletionStage;

import reactor.core.publisher.Mono;

/**
 * A {@link RedisClient} of a Sentinel {@link RedisURI} that connects only to the primary a
 * majority of the listed sentinels name, asking all of them on every connection and every
 * reconnection: Lettuce's own lookup trusts the first sentinel that answers, which may not have
 * heard of a failover yet, or name a restarted old primary that answers as an empty one
 * (docs/protocol.md section 5, failover). Without a majority a connection attempt fails with the
 * error of {@link SentinelVotes#noMajority()}; reconnections keep trying.
 */
final class SentinelClient extends RedisClient {
    SentinelClient(RedisURI uri) {
        super(null, uri);
    }

    /** The address of the primary the sentinels' majority names, for a Sentinel URI; else Lettuce's. */
    @Override
    protected Mono<SocketAddress> getSocketAddress(RedisURI uri) {
        if (uri.getSentinelMasterId() == null || uri.getSentinels().isEmpty()) {
            return super.getSocketAddress(uri);
        }
        return Mono.defer(() -> Mono.fromFuture(primary(uri)));
    }

    private CompletableFuture<SocketAddress> primary(RedisURI uri) {
        String master = uri.getSentinelMasterId();
        List<RedisURI> sentinels = uri.getSentinels();
        SentinelVotes votes = new SentinelVotes(master, sentinels.stream().map(SentinelClient::name).toList());
        CompletableFuture<SocketAddress> result = new CompletableFuture<>();
        for (RedisURI sentinel : sentinels) {
            ask(sentinel, master).whenComplete((state, error) -> {
                synchronized (votes) {
                    if (error == null) {
                        votes.named(name(sentinel), state);
                    } else {
                        votes.failed(name(sentinel), error instanceof CompletionException ? error.getCause() : error);
                    }
                    if (result.isDone() || !votes.decided()) {
                        return;
                    }
                    SentinelVotes.Address p = votes.majority();
                    if (p == null) {
                        result.completeExceptionally(votes.noMajority());
                        return;
                    }
                    try {
                        result.complete(getResources().socketAddressResolver().resolve(RedisURI.create(p.host(), p.port())));
                    } catch (RuntimeException e) {
                        result.completeExceptionally(e);
                    }
                }
            });
        }
        return result;
    }

    /** {@code SENTINEL MASTER <master>} on a connection of its own (TLS, credentials and timeout of {@code sentinel}). */
    private CompletionStage<Map<String, String>> ask(RedisURI sentinel, String master) {
        return connectSentinelAsync(StringCodec.UTF8, sentinel).thenCompose(c -> c.async().master(master)
                .whenComplete((state, error) -> c.closeAsync()));
    }

    private static String name(RedisURI sentinel) {
        return new SentinelVotes.Address(sentinel.getHost(), sentinel.getPort()).toString();
    }
}
