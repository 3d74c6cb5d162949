package io.kombuenvelope;

import java.util.Locale;

/**
 * What a cancel did (docs/protocol.md section 10): the task was {@link Outcome#REMOVED removed} from
 * the delayed set of {@code queue}, or only {@link Outcome#MARKED marked}, or it was
 * {@link Outcome#ALREADY already} marked. The mark is written in every case.
 *
 * @param outcome what happened
 * @param queue   the queue whose delayed set held the task; null unless {@link Outcome#REMOVED}
 */
public record CancelResult(Outcome outcome, String queue) {
    /** The outcomes of section 10. */
    public enum Outcome {
        REMOVED, MARKED, ALREADY;

        /** The protocol's word: {@code removed}, {@code marked} or {@code already}. */
        public String word() {
            return name().toLowerCase(Locale.ROOT);
        }
    }
}
